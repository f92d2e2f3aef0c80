"""Deployments as declared, signed, converging facts (`facts.deployments`)."""

from __future__ import annotations

import itertools

import msgspec

from certs import new_node_id
from certs.identity import issue_node_cert, make_ca, new_key
from facts.deployments import MAX_DEPLOYMENTS, Deployment, DeploymentSet
from facts.record_signing import RecordVerifier, sign_statement

DEP = "dep_" + "0" * 26


def version(n: int, at: int, by: str, **fields: object) -> Deployment:
    base = Deployment(id=DEP, name="llama", engine="vllm", version=n, updatedAt=at, by=by)
    return msgspec.structs.replace(base, **fields)


def test_concurrent_edits_converge_to_one_version_in_any_order() -> None:
    # Two members edit version 3 at once; a third hears both in either order.
    edits = [
        version(3, 100, "nod_a", replicas=3),
        version(4, 200, "nod_a", replicas=4),
        version(4, 200, "nod_b", replicas=1),  # same version and time: the node id decides
        version(4, 150, "nod_c", replicas=9),
    ]
    outcomes = set()
    for order in itertools.permutations(edits):
        held = DeploymentSet()
        for d in order:
            held.offer(d)
        outcomes.add(msgspec.json.encode(held.all()))
    assert outcomes == {msgspec.json.encode([edits[2]])}


def test_an_undeploy_is_not_undone_by_a_late_older_version() -> None:
    held = DeploymentSet()
    assert held.offer(version(1, 10, "nod_a"))
    assert held.offer(version(2, 20, "nod_b", deleted=True))
    assert not held.offer(version(1, 10, "nod_a"))  # a late copy of the first
    assert held.live() == []
    assert held.next_version("llama") == 3  # a redeploy outranks the tombstone
    assert held.offer(version(3, 30, "nod_a"))
    assert [d.version for d in held.live()] == [3]


def test_the_set_is_bounded_and_old_tombstones_go_first() -> None:
    held = DeploymentSet()
    for i in range(MAX_DEPLOYMENTS):
        held.offer(version(1, i, "nod_a", name=f"m{i}", deleted=i == 5))
    assert held.offer(version(1, 999, "nod_a", name="new"))  # took the tombstone's place
    assert held.get("m5") is None
    assert not held.offer(version(1, 1000, "nod_a", name="newer"))  # no tombstone left
    assert held.forget_old_tombstones(now_ms=10**15) == []


def test_a_deployment_is_taken_only_as_a_members_signed_statement() -> None:
    ca_key, ca_cert = make_ca("lab")
    key, node_id = new_key(), new_node_id()
    cert = issue_node_cert(
        ca_key=ca_key, ca_cert=ca_cert, public_key=key.public_key(), node_id=node_id, name="a"
    )
    signed = sign_statement(version(1, 10, ""), key, cert)
    assert signed.by == node_id
    verifier = RecordVerifier()
    assert verifier.statement_why_not(signed, ca_cert, "a deployment") is None
    for bad in (
        version(1, 10, node_id),  # unsigned
        msgspec.structs.replace(signed, replicas=64),  # changed after signing
        msgspec.structs.replace(signed, by=new_node_id()),  # another member's name
    ):
        assert verifier.statement_why_not(bad, ca_cert, "a deployment") is not None
    other_ca = make_ca("elsewhere")[1]
    assert verifier.statement_why_not(signed, other_ca, "a deployment") is not None
    assert verifier.refused == 4
