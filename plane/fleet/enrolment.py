"""The admin token and cluster enrolment: tokens stored as hashes, revocation.

Functions over one connection; `PlaneStore` takes the connection and translates errors.
"""

from __future__ import annotations

import secrets

import psycopg

from plane.core.errors import ClusterNameTaken
from plane.core.ids import new_id
from plane.core.tokens import hash_token, mint_token, token_cluster, token_matches
from plane.db.connection import Conn
from plane.fleet.node_signing import ClusterCa

__all__ = ["cluster_for", "enrol", "ensure_admin", "is_admin", "revoke"]

ADMIN_TOKEN_PREFIX = "nvpadm1."


async def ensure_admin(conn: Conn, token: str | None) -> str | None:
    """Store the admin token's hash (`token`, or a fresh one on first start); returns a
    fresh token to print once, else None."""
    cursor = await conn.execute("SELECT token_hash FROM admin WHERE id = 1")
    row = await cursor.fetchone()
    if token is not None:
        await conn.execute(
            "INSERT INTO admin (id, token_hash) VALUES (1, %s) "
            "ON CONFLICT (id) DO UPDATE SET token_hash = excluded.token_hash",
            (hash_token(token),),
        )
        return None
    if row is not None:
        return None
    fresh = ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)
    await conn.execute("INSERT INTO admin (id, token_hash) VALUES (1, %s)", (hash_token(fresh),))
    return fresh


async def is_admin(conn: Conn, token: str) -> bool:
    """Whether `token` is the admin token."""
    cursor = await conn.execute("SELECT token_hash FROM admin WHERE id = 1")
    row = await cursor.fetchone()
    return row is not None and token_matches(token, row[0])


async def enrol(conn: Conn, name: str, ca: ClusterCa | None = None) -> tuple[str, str]:
    """A new cluster and its token (shown once; stored as a hash), bound to `ca` when given
    (else to the CA of its first signed sync); `ClusterNameTaken` when a cluster of that
    name exists, revoked or not."""
    cluster_id = new_id("clu")
    token = mint_token(cluster_id)
    spki, der = (ca.spki_sha256, ca.der) if ca is not None else (None, None)
    try:
        await conn.execute(
            "INSERT INTO clusters (id, name, token_hash, ca_spki_sha256, ca_der, ca_bound_at) "
            "VALUES (%s, %s, %s, %s, %s, CASE WHEN %s::bytea IS NULL THEN NULL ELSE now() END)",
            (cluster_id, name, hash_token(token), spki, der, spki),
        )
    except psycopg.errors.UniqueViolation as exc:
        # The id is fresh, so the name is what collided (clusters.name is UNIQUE).
        raise ClusterNameTaken(f"a cluster named {name[:128]!r} is enrolled already") from exc
    return cluster_id, token


async def revoke(conn: Conn, cluster_id: str) -> bool:
    """Revoke the cluster's token; False when there is no such active cluster."""
    cursor = await conn.execute(
        "UPDATE clusters SET revoked_at = now() WHERE id = %s AND revoked_at IS NULL",
        (cluster_id,),
    )
    return cursor.rowcount == 1


async def cluster_for(conn: Conn, token: str) -> str | None:
    """The cluster a valid, unrevoked token belongs to, or None."""
    cluster_id = token_cluster(token)
    if cluster_id is None:
        return None
    cursor = await conn.execute(
        "SELECT token_hash FROM clusters WHERE id = %s AND revoked_at IS NULL", (cluster_id,)
    )
    row = await cursor.fetchone()
    return cluster_id if row is not None and token_matches(token, row[0]) else None
