"""Binding a cluster to its CA: trust on first use of the enrolment token.

The token is the secret that enrols a cluster, and the admin who runs `enrol-cluster` does
not usually hold the cluster's CA (a node of the cluster does), so the first sync with a
valid token that is signed by a node of some CA binds that CA to the cluster -- unless
`enrol-cluster --ca` bound it up front. From then on a sync whose certificate another CA
issued is refused. The CA is compared by its key (the SHA-256 of its SubjectPublicKeyInfo).

The binding is written by the statement that ends every sync's transaction (it updates the
cluster's row anyway), so two first syncs racing with different CAs bind one: the other
waits for the row, finds it bound, and is rolled back.
"""

from __future__ import annotations

from typing import Final

from plane.core.errors import SignatureRefused
from plane.db.connection import Conn
from plane.fleet.node_signing import ClusterCa

__all__ = ["bind_ca", "refuse_another_ca"]

_BIND: Final = (
    b"UPDATE clusters SET last_sync_at = now(), "
    b"ca_spki_sha256 = coalesce(ca_spki_sha256, %(spki)s), ca_der = coalesce(ca_der, %(der)s), "
    b"ca_bound_at = coalesce(ca_bound_at, now()) WHERE id = %(id)s RETURNING ca_spki_sha256"
)


def _another(cluster_id: str) -> SignatureRefused:
    return SignatureRefused(
        f"this sync is signed by another cluster CA than the one {cluster_id} is bound to"
    )


async def refuse_another_ca(conn: Conn, cluster_id: str, ca: ClusterCa) -> None:
    """`SignatureRefused` when the cluster is bound to a CA other than `ca`: the early
    answer, before a batch's work (`bind_ca` is the one that holds under a race)."""
    cursor = await conn.execute(b"SELECT ca_spki_sha256 FROM clusters WHERE id = %s", (cluster_id,))
    row = await cursor.fetchone()
    if row is not None and row[0] is not None and bytes(row[0]) != ca.spki_sha256:
        raise _another(cluster_id)


async def bind_ca(conn: Conn, cluster_id: str, ca: ClusterCa) -> None:
    """Note the sync on the cluster's row and bind `ca` if none is; `SignatureRefused`
    when another is bound (the caller's transaction then writes nothing)."""
    cursor = await conn.execute(_BIND, {"spki": ca.spki_sha256, "der": ca.der, "id": cluster_id})
    row = await cursor.fetchone()
    if row is None or bytes(row[0]) != ca.spki_sha256:
        raise _another(cluster_id)
