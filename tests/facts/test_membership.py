"""The membership and pin policy, without sockets or files: what a records push changes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from cryptography import x509

from certs import new_node_id
from certs.identity import PrivateKey, cert_pem, issue_node_cert, load_cert, make_ca, new_key
from facts.kept import raws
from facts.membership import PushPlan, manager_peers, plan_push
from facts.record_signing import MAX_SKEW_MS, RecordVerifier, sign_record, sign_removal
from facts.records import NodeRecord, RecordsPush, Removal
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


def removal(ca: CA, node_id: str, by: str = "", at: int = 5) -> Removal:
    """A removal of `node_id` signed by member `by` (B unless said), as members push them."""
    by = by or B
    cert = load_cert(node_cert(ca, by).encode())
    return sign_removal(Removal(nodeId=node_id, removedAt=at), KEYS[by], cert)


def offers(result: PushPlan) -> tuple[NodeRecord, ...]:
    """The records a plan offers, as understood."""
    return tuple(k.fact for k in result.offers)


def tombstones(result: PushPlan) -> tuple[Removal, ...]:
    """The removals a plan takes, as understood."""
    return tuple(k.fact for k in result.tombstones)


def plan(
    push: RecordsPush,
    ca_cert: x509.Certificate,
    members: set[str],
    removed: set[str],
    verifier: RecordVerifier | None = None,
    removed_at: dict[str, int] | None = None,
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
        removed_at=(removed_at or {}).get,
    )


def test_a_member_cannot_speak_for_another(ca: CA) -> None:
    now = int(time.time() * 1000)
    forged = sign_record(node_record(C, 2**62, addresses=("10.6.6.6",)), KEYS[B])
    unsigned = node_record(C, 5)
    altered = msgspec.structs.replace(rec(C, 6), cordoned=True)  # signed, then changed
    future = rec(C, now + MAX_SKEW_MS + 60_000)
    verifier = RecordVerifier()
    for bad in (forged, unsigned, altered, future):
        result = plan(RecordsPush(records=raws([bad])), ca[1], {B, C}, set(), verifier)
        assert offers(result) == (), bad
        assert len(result.refused) == 1
    assert verifier.refused == 4
    # The control: C's own record, signed by C, within the skew, is taken -- twice (the
    # second from the cache).
    good = rec(C, now)
    for _ in range(2):
        assert offers(plan(RecordsPush(records=raws([good])), ca[1], {B, C}, set(), verifier)) == (
            good,
        )
    assert verifier.refused == 4


def test_only_pinned_members_records_are_offered_and_never_ours(
    ca: CA,
) -> None:
    push = RecordsPush(records=raws([rec(ME, 99), rec(B), rec(C)]))
    result = plan(push, ca[1], members={B}, removed=set())
    assert [r.nodeId for r in offers(result)] == [B]  # not ours (only a node speaks for itself)
    assert (result.pins, tombstones(result)) == ((), ())


def test_a_new_member_is_pinned_and_its_record_taken_in_the_same_push(
    ca: CA,
) -> None:
    push = RecordsPush(records=raws([rec(C)]), certificates=[node_cert(ca, C)])
    result = plan(push, ca[1], members={B}, removed=set())
    assert [p.node_id for p in result.pins] == [C]
    assert [r.nodeId for r in offers(result)] == [C]


def test_a_certificate_from_another_ca_is_refused(ca: CA) -> None:
    other = make_ca("elsewhere")
    push = RecordsPush(
        records=raws([rec(C)]), certificates=[node_cert(other, C), "not a pem", node_cert(ca, B)]
    )
    result = plan(push, ca[1], members=set(), removed=set())
    assert [p.node_id for p in result.pins] == [B]  # the control: a good one is pinned
    assert offers(result) == ()  # C is not pinned, so its record is not taken
    assert len(result.refused) == 2
    assert any("not signed by our CA" in reason for reason in result.refused)


def test_a_tombstone_wins_over_a_certificate_and_a_record_in_the_same_push(
    ca: CA,
) -> None:
    push = RecordsPush(
        records=raws([rec(C, 10**12), rec(B)]),
        removals=raws([removal(ca, C)]),
        certificates=[node_cert(ca, C)],
    )
    result = plan(push, ca[1], members={B, C}, removed=set())
    assert [t.nodeId for t in tombstones(result)] == [C]
    assert result.pins == ()
    assert [r.nodeId for r in offers(result)] == [B]


def test_known_tombstones_and_our_own_removal_are_not_new(
    ca: CA,
) -> None:
    push = RecordsPush(
        removals=raws([removal(ca, ME, at=1), removal(ca, C, at=2)]),
        certificates=[node_cert(ca, C), node_cert(ca, ME)],
        records=raws([rec(C)]),
    )
    result = plan(push, ca[1], members={B}, removed={C})
    # A removed node keeps its own view; an old tombstone is not news; C stays out.
    assert (tombstones(result), result.pins, offers(result)) == ((), (), ())


def test_a_removal_is_taken_only_as_a_members_signed_statement(ca: CA) -> None:
    other_ca = make_ca("elsewhere")
    good = removal(ca, C)
    stranger = sign_removal(
        Removal(nodeId=C, removedAt=5), KEYS[B], load_cert(node_cert(other_ca, B).encode())
    )
    verifier = RecordVerifier()
    for bad in (
        Removal(nodeId=C, removedAt=5),  # unsigned
        msgspec.structs.replace(good, removedAt=6),  # signed, then changed
        msgspec.structs.replace(good, by=ME),  # B's signature and certificate, ME's name
        stranger,  # signed by a certificate of another CA
    ):
        result = plan(RecordsPush(removals=raws([bad])), ca[1], {B, C}, set(), verifier)
        assert tombstones(result) == (), bad
        assert len(result.refused) == 1
    assert verifier.refused == 4
    # The control: B's signed removal is taken, even where B is not pinned (it carries
    # B's certificate, which chains to the CA), and from the cache the second time.
    for members in ({B, C}, {C}):
        result = plan(RecordsPush(removals=raws([good])), ca[1], members, set(), verifier)
        assert tombstones(result) == (good,)
    assert verifier.refused == 4


def test_a_removed_member_removes_nobody_after_its_own_removal(ca: CA) -> None:
    before, after = removal(ca, C, by=B, at=10), removal(ca, C, by=B, at=30)
    assert tombstones(
        plan(RecordsPush(removals=raws([before])), ca[1], {C}, set(), removed_at={B: 20})
    )
    result = plan(RecordsPush(removals=raws([after])), ca[1], {C}, set(), removed_at={B: 20})
    assert tombstones(result) == ()
    assert "after" in result.refused[0]
    # The same within one push: B's removal (by C) comes first, then B's later statement.
    push = RecordsPush(removals=raws([removal(ca, B, by=C, at=20), after]))
    assert [t.nodeId for t in tombstones(plan(push, ca[1], {B, C}, set()))] == [B]


def test_manager_peers_are_pinned_members_with_an_address() -> None:
    records = [rec(B), rec(C), node_record("nod_noaddress", addresses=())]
    peers = manager_peers(records, {B, "nod_noaddress"}.__contains__)
    assert [(p.nodeId, p.host, p.port) for p in peers] == [(B, "127.0.0.1", 14320)]
