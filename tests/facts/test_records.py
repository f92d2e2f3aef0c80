"""Membership: newer generations win, tombstones win, reachability needs fresh news, and
the version moves with every change to the records held."""

from __future__ import annotations

from facts.records import Membership, Removal
from tests.fixtures.records import node_record as rec


def test_newer_generation_wins() -> None:
    members = Membership("me")
    assert members.offer(rec("b", 2), now=0)
    assert not members.offer(rec("b", 1), now=0)
    assert not members.offer(rec("b", 2), now=0)
    assert members.offer(rec("b", 3), now=0)
    record = members.record("b")
    assert record is not None
    assert record.generation == 3


def test_a_relayed_old_record_does_not_keep_a_dead_node_reachable() -> None:
    members = Membership("me", unreachable_after_s=6)
    members.offer(rec("b", 5), now=0)
    assert members.reachable("b", now=5)
    members.offer(rec("b", 5), now=5)  # the same record, relayed by someone else
    assert not members.reachable("b", now=7)
    members.offer(rec("b", 6), now=8)  # news from b itself
    assert members.reachable("b", now=9)


def test_direct_contact_counts() -> None:
    members = Membership("me", unreachable_after_s=6)
    members.offer(rec("b", 5), now=0)
    members.heard_from("b", now=10)
    assert members.reachable("b", now=12)
    assert members.reachable("me", now=1000)


def test_tombstone_wins_over_any_generation() -> None:
    members = Membership("me")
    members.offer(rec("c", 9), now=0)
    assert members.remove(Removal(nodeId="c", removedAt=1))
    assert not members.remove(Removal(nodeId="c", removedAt=2))
    assert members.record("c") is None
    assert not members.offer(rec("c", 10**12), now=1)
    assert [r.nodeId for r in members.removals()] == ["c"]
    assert members.peers() == []


def test_the_version_moves_with_every_record_taken_or_removed_and_only_then() -> None:
    # What placement derives from the records per request is derived again only when this
    # moves (agent.cluster.members.working_records): a change it missed would go unseen.
    members = Membership("me")
    seen = members.version
    assert members.offer(rec("b", 2), now=0)
    assert members.version > seen
    seen = members.version
    members.offer(rec("b", 2), now=1)  # the same record, relayed again
    members.offer(rec("b", 1), now=1)  # an older one
    members.heard_from("b", now=2)  # reachability is not a record
    assert members.version == seen
    assert members.offer(rec("b", 3), now=3)
    assert members.version > seen
    seen = members.version
    assert members.remove(Removal(nodeId="b", removedAt=1))
    assert members.version > seen
    seen = members.version
    assert not members.remove(Removal(nodeId="b", removedAt=2))
    assert members.version == seen
