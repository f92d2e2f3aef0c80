"""Only a node speaks for itself: a sync is written only when the node it names signed it,
with a certificate of the cluster's CA. A real plane HTTP server on a real PostgreSQL, real
keys and certificates from `certs` (`plane.fleet.node_signing`, docs/plane.md)."""

from __future__ import annotations

import asyncio
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from certs.identity import NODE_VALIDITY, cert_pem
from plane.core.errors import SignatureRefused
from plane.fleet.node_signing import (
    CLUSTER_CA_HEADER,
    NODE_CERTIFICATE_HEADER,
    SIGNATURE_HEADER,
    SyncVerifier,
    read_signature,
)

from ..db.test_store import batch, job
from ..plane_client import ADMIN, ClusterCa, Plane, enrol, signed

JSON = {"Content-Type": "application/json"}
TABLES = ("nodes", "devices", "topology_domains", "jobs", "job_rollup")


async def stored(plane: Plane) -> dict[str, Any]:
    """Every row the plane holds, and each cluster's bound CA."""
    async with plane.store.pool.connection() as conn:
        found: dict[str, Any] = {}
        for table in TABLES:
            cursor = await conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2".encode())
            found[table] = await cursor.fetchall()
        cursor = await conn.execute(b"SELECT id, ca_spki_sha256, ca_der FROM clusters ORDER BY id")
        found["cas"] = await cursor.fetchall()
        return found


async def post(plane: Plane, token: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """(status, error) of a sync sent with exactly these signature headers."""
    status, answer = await plane.call(
        "POST", "/v1/sync", token, body, sign=False, headers={**JSON, **headers}
    )
    return status, (answer or {}).get("error", "")


def body_of(node: str, generation: int = 5, jobs: int = 2) -> bytes:
    return msgspec.json.encode(batch(node, generation, [job(node, str(i), 3) for i in range(jobs)]))


async def honest_cluster(plane: Plane) -> tuple[str, ClusterCa, str]:
    """A cluster whose node X synced honestly (binding the cluster's CA): (token, CA, X)."""
    _, token = await enrol(plane, "lab")
    ca = plane.ca(token)
    x = ca.node().node.node_id
    body = body_of(x)
    assert await post(plane, token, body, signed(body, ca.node(x))) == (200, "")
    return token, ca, x


async def test_a_node_cannot_sync_in_another_nodes_name(plane: Plane) -> None:
    token, ca, x = await honest_cluster(plane)
    before = await stored(plane)
    y = ca.node()  # a node of the same cluster: the token, its own valid certificate
    forged = body_of(x, generation=99, jobs=3)  # newer-wins alone would take it
    status, error = await post(plane, token, forged, signed(forged, y))
    assert status == 403
    assert f"in {x}'s name signed by {y.node.node_id}" in error
    assert await stored(plane) == before
    # The control: the same node's own batch is written, next to X's rows.
    own = body_of(y.node.node_id, jobs=3)
    assert (await post(plane, token, own, signed(own, y)))[0] == 200
    after = await stored(plane)
    assert {row[0] for row in after["nodes"]} == {x, y.node.node_id}
    assert set(before["jobs"]) <= set(after["jobs"])


async def test_a_body_altered_after_signing_is_refused(plane: Plane) -> None:
    token, ca, x = await honest_cluster(plane)
    before = await stored(plane)
    body = body_of(x, generation=6)
    headers = signed(body, ca.node(x))
    altered = body.replace(b'"generation":6', b'"generation":7')
    assert altered != body
    status, error = await post(plane, token, altered, headers)
    assert (status, error) == (403, f"the body's signature does not verify with {x}'s certificate")
    assert await stored(plane) == before
    assert (await post(plane, token, body, headers))[0] == 200  # the control: as signed


async def test_a_certificate_of_another_ca_is_refused(plane: Plane) -> None:
    token, ca, x = await honest_cluster(plane)
    before = await stored(plane)
    stranger = ClusterCa("stranger").node(x)  # X's id, but another CA issued it
    body = body_of(x, generation=9)
    # With the cluster's CA in the header: the certificate does not verify against it.
    headers = signed(body, stranger) | {
        CLUSTER_CA_HEADER: signed(body, ca.node(x))[CLUSTER_CA_HEADER]
    }
    status, error = await post(plane, token, body, headers)
    assert (status, error) == (403, "the node certificate was not issued by the cluster CA sent")
    assert await stored(plane) == before


async def test_a_second_ca_for_a_bound_cluster_is_refused(plane: Plane) -> None:
    token, _, x = await honest_cluster(plane)
    before = await stored(plane)
    other = ClusterCa("other")
    for node in (x, other.node().node.node_id):  # X's name or a new node's, whole and valid
        body = body_of(node, generation=9)
        status, error = await post(plane, token, body, signed(body, other.node(node)))
        assert status == 403
        assert "signed by another cluster CA" in error
        assert await stored(plane) == before


async def test_an_expired_node_certificate_is_refused(plane: Plane) -> None:
    token, ca, x = await honest_cluster(plane)
    before = await stored(plane)
    long_ago = datetime.datetime.now(datetime.UTC) - 2 * NODE_VALIDITY
    expired = ca.node(x, now=long_ago)
    assert expired.cert.not_valid_after_utc < datetime.datetime.now(datetime.UTC)
    body = body_of(x, generation=9)
    status, error = await post(plane, token, body, signed(body, expired))
    assert status == 403
    assert error.startswith("the node certificate is not valid now")
    assert await stored(plane) == before


async def test_unsigned_and_malformed_signatures_are_refused(plane: Plane) -> None:
    _, token = await enrol(plane, "lab")  # no CA bound yet: unsigned is refused all the same
    before = await stored(plane)
    body = body_of(plane.ca(token).node().node.node_id)
    status, error = await post(plane, token, body, {})
    assert status == 403
    assert error.startswith("an unsigned sync is refused")
    good = plane.ca(token).headers(body)
    for name, value in [
        (SIGNATURE_HEADER, None),
        (NODE_CERTIFICATE_HEADER, "not base64url!"),
        (CLUSTER_CA_HEADER, "A" * 5000),
        (NODE_CERTIFICATE_HEADER, "AAAA"),  # base64url, but no certificate
    ]:
        headers = {k: v for k, v in good.items() if k != name}
        if value is not None:
            headers[name] = value
        status, error = await post(plane, token, body, headers)
        assert status == 400, (name, value, error)
        assert name in error or "DER" in error
    assert await stored(plane) == before
    assert (await post(plane, token, body, good))[0] == 200  # the control


async def test_two_first_syncs_of_different_cas_bind_one(plane: Plane) -> None:
    _, token = await enrol(plane, "lab")
    first, second = ClusterCa("first"), ClusterCa("second")
    bodies = [(body_of(ca.node().node.node_id), ca) for ca in (first, second)]
    answers = await asyncio.gather(
        *(post(plane, token, body, ca.headers(body)) for body, ca in bodies)
    )
    assert sorted(status for status, _ in answers) == [200, 403]
    rows = await stored(plane)
    assert len(rows["nodes"]) == 1  # only the winner's batch
    winner = first if answers[0][0] == 200 else second
    assert bytes(rows["cas"][0][2]) == winner.cert.public_bytes(Encoding.DER)


async def test_enrolment_can_bind_the_ca_up_front(plane: Plane) -> None:
    ca = ClusterCa("given")
    pem = cert_pem(ca.cert).decode()
    status, answer = await plane.call("POST", "/v1/clusters", ADMIN, {"name": "lab", "ca": pem})
    assert status == 201, answer
    token = answer["token"]
    before = await stored(plane)
    body = body_of(plane.ca(token).node().node.node_id)  # a CA the cluster was not given
    status, error = await post(plane, token, body, plane.ca(token).headers(body))
    assert (status, "signed by another cluster CA" in error) == (403, True)
    assert await stored(plane) == before
    assert (await post(plane, token, body, ca.headers(body)))[0] == 200
    node_pem = cert_pem(ca.node().cert).decode()  # a node's certificate is no CA
    status, answer = await plane.call("POST", "/v1/clusters", ADMIN, {"name": "b", "ca": node_pem})
    assert (status, answer["error"]) == (400, "ca is the PEM of the cluster's CA certificate")


async def test_enrol_cluster_ca_binds_the_file_it_is_given(plane: Plane, tmp_path: Path) -> None:
    ca = ClusterCa("given")
    (tmp_path / "ca.crt").write_bytes(cert_pem(ca.cert))
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "agent", "plane", "enrol-cluster", "lab", "--plane", plane.url),
        *("--ca", str(tmp_path / "ca.crt")),
        env={**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    token = out.decode().strip()
    body = body_of(plane.ca(token).node().node.node_id)
    assert (await post(plane, token, body, plane.ca(token).headers(body)))[0] == 403
    assert (await post(plane, token, body, ca.headers(body)))[0] == 200


def test_the_chain_cache_is_bounded_and_validity_is_checked_every_time() -> None:
    verifier = SyncVerifier(cache_size=3)
    ca = ClusterCa()
    identities = [ca.node() for _ in range(5)]
    now = datetime.datetime.now(datetime.UTC)
    for identity in identities:
        body = body_of(identity.node.node_id)
        verifier.check(
            read_signature(signed(body, identity)), body, node_id=identity.node.node_id, now=now
        )
    assert len(verifier._issued) == 3
    last = identities[-1]
    body = body_of(last.node.node_id)
    later = last.cert.not_valid_after_utc + datetime.timedelta(seconds=1)
    with pytest.raises(SignatureRefused, match="not valid now"):  # cached, yet refused
        verifier.check(
            read_signature(signed(body, last)), body, node_id=last.node.node_id, now=later
        )
