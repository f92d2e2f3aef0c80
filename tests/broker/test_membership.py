"""The membership and pin policy, without sockets or files: what a records push changes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from cryptography import x509

from broker.membership import PushPlan, manager_peers, plan_push
from broker.record_signing import MAX_SKEW_MS, RecordVerifier, sign_record
from broker.records import NodeRecord, RecordsPush, Removal
from certs import new_node_id
from certs.identity import PrivateKey, cert_pem, issue_node_cert, make_ca, new_key
from tests.fixtures.records import node_record

CA = tuple[PrivateKey, x509.Certificate]


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca("lab")


def node_cert(ca: CA, node_id: str) -> str:
    ca_key, ca_cert = ca
    return cert_pem(
        issue_node_cert(
            ca_key=ca_key,
            ca_cert=ca_cert,
            public_key=KEYS[node_id].public_key(),
            node_id=node_id,
            name=node_id[-4:],
        )
    ).decode()


ME, B, C = new_node_id(), new_node_id(), new_node_id()
KEYS = {node_id: new_key() for node_id in (ME, B, C)}


def rec(node_id: str, generation: int = 1, **fields: Any) -> NodeRecord:
    """A record signed by its owner, as members push them."""
    return sign_record(node_record(node_id, generation, **fields), KEYS[node_id])


def plan(
    push: RecordsPush,
    ca_cert: x509.Certificate,
    members: set[str],
    removed: set[str],
    verifier: RecordVerifier | None = None,
) -> PushPlan:
    return plan_push(
        push,
        self_id=ME,
        ca=ca_cert,
        is_member=members.__contains__,
        is_removed=removed.__contains__,
        key_of=lambda node_id: KEYS[node_id].public_key() if node_id in members else None,
        verifier=verifier or RecordVerifier(),
        now_ms=int(time.time() * 1000),
    )


def test_a_member_cannot_speak_for_another(ca: CA) -> None:
    now = int(time.time() * 1000)
    forged = sign_record(node_record(C, 2**62, addresses=("10.6.6.6",)), KEYS[B])
    unsigned = node_record(C, 5)
    altered = msgspec.structs.replace(rec(C, 6), cordoned=True)  # signed, then changed
    future = rec(C, now + MAX_SKEW_MS + 60_000)
    verifier = RecordVerifier()
    for bad in (forged, unsigned, altered, future):
        result = plan(RecordsPush(records=[bad]), ca[1], {B, C}, set(), verifier)
        assert result.offers == (), bad
        assert len(result.refused) == 1
    assert verifier.refused == 4
    # The control: C's own record, signed by C, within the skew, is taken -- twice (the
    # second from the cache).
    good = rec(C, now)
    for _ in range(2):
        assert plan(RecordsPush(records=[good]), ca[1], {B, C}, set(), verifier).offers == (good,)
    assert verifier.refused == 4


def test_only_pinned_members_records_are_offered_and_never_ours(
    ca: CA,
) -> None:
    push = RecordsPush(records=[rec(ME, 99), rec(B), rec(C)])
    result = plan(push, ca[1], members={B}, removed=set())
    assert [r.nodeId for r in result.offers] == [B]  # not ours (only a node speaks for itself)
    assert (result.pins, result.tombstones) == ((), ())


def test_a_new_member_is_pinned_and_its_record_taken_in_the_same_push(
    ca: CA,
) -> None:
    push = RecordsPush(records=[rec(C)], certificates=[node_cert(ca, C)])
    result = plan(push, ca[1], members={B}, removed=set())
    assert [p.node_id for p in result.pins] == [C]
    assert [r.nodeId for r in result.offers] == [C]


def test_a_certificate_from_another_ca_is_refused(ca: CA) -> None:
    other = make_ca("elsewhere")
    push = RecordsPush(
        records=[rec(C)], certificates=[node_cert(other, C), "not a pem", node_cert(ca, B)]
    )
    result = plan(push, ca[1], members=set(), removed=set())
    assert [p.node_id for p in result.pins] == [B]  # the control: a good one is pinned
    assert result.offers == ()  # C is not pinned, so its record is not taken
    assert len(result.refused) == 2
    assert any("not signed by our CA" in reason for reason in result.refused)


def test_a_tombstone_wins_over_a_certificate_and_a_record_in_the_same_push(
    ca: CA,
) -> None:
    push = RecordsPush(
        records=[rec(C, 10**12), rec(B)],
        removals=[Removal(nodeId=C, removedAt=5)],
        certificates=[node_cert(ca, C)],
    )
    result = plan(push, ca[1], members={B, C}, removed=set())
    assert [t.nodeId for t in result.tombstones] == [C]
    assert result.pins == ()
    assert [r.nodeId for r in result.offers] == [B]


def test_known_tombstones_and_our_own_removal_are_not_new(
    ca: CA,
) -> None:
    push = RecordsPush(
        removals=[Removal(nodeId=ME, removedAt=1), Removal(nodeId=C, removedAt=2)],
        certificates=[node_cert(ca, C), node_cert(ca, ME)],
        records=[rec(C)],
    )
    result = plan(push, ca[1], members={B}, removed={C})
    # A removed node keeps its own view; an old tombstone is not news; C stays out.
    assert (result.tombstones, result.pins, result.offers) == ((), (), ())


def test_manager_peers_are_pinned_members_with_an_address() -> None:
    records = [rec(B), rec(C), node_record("nod_noaddress", addresses=())]
    peers = manager_peers(records, {B, "nod_noaddress"}.__contains__)
    assert [(p.nodeId, p.host, p.port) for p in peers] == [(B, "127.0.0.1", 14320)]
