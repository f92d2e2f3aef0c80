"""Releases side by side (`facts.wire`): who works with whom, the message that refuses a
member two releases apart, and the cluster-wide feature gate (issue 27)."""

from __future__ import annotations

import pytest

from facts import wire
from facts.wire import LEGACY, Range, gate, parse_range, refusal

THIS = Range("0.2.0", 1, 2)
NEXT = Range("0.3.0", 2, 3)
AFTER = Range("0.4.0", 3, 4)


def test_one_release_apart_work_together_and_two_apart_are_refused_naming_both() -> None:
    assert refusal(THIS, NEXT, who="nod_b") is None  # one apart: they share wire 2
    assert refusal(THIS, LEGACY, who="nod_b") is None  # 0.1.0 speaks wire 1 alone
    why = refusal(THIS, AFTER, who="nod_b")
    assert why is not None
    assert "nod_b runs nvpair 0.4.0 (wire 3-4)" in why
    assert "this member runs nvpair 0.2.0 (wire 1-2)" in why
    assert "upgrade the member on 0.2.0" in why  # the older one moves first
    older = refusal(AFTER, LEGACY, who="nod_c")  # and from the newer member's side
    assert older is not None
    assert "0.1.0 or older (wire 1)" in older
    assert "0.4.0" in older
    assert "upgrade the member on 0.1.0 or older" in older


def test_the_gate_opens_only_once_every_member_speaks_the_version() -> None:
    features = {"kept": 2, "next-thing": 3}
    mixed = gate({"a": THIS, "b": NEXT, "c": NEXT}, features, mine=NEXT)
    assert mixed.wire == 2
    assert (mixed.on, mixed.off) == (("kept",), ("next-thing",))
    assert not mixed.allows("next-thing")
    assert [n for n, _ in mixed.held_back_by] == ["a"]  # who to upgrade
    upgraded = gate({"a": NEXT, "b": NEXT, "c": NEXT}, features, mine=NEXT)
    assert upgraded.wire == 3
    assert upgraded.allows("next-thing")
    assert upgraded.held_back_by == ()
    # Seen from the older member, the cluster speaks at most what it speaks itself.
    assert gate({"a": THIS, "b": NEXT}, features, mine=THIS).wire == 2
    # A member two releases apart is refused, not counted: it holds nothing back.
    assert gate({"a": NEXT, "z": LEGACY}, features, mine=NEXT).wire == 3


def test_this_release_speaks_its_own_and_the_previous_wire_version() -> None:
    assert (wire.WIRE_MIN, wire.WIRE_MAX) == (1, 2)
    assert all(1 <= v <= wire.WIRE_MAX for v in wire.FEATURES.values())
    assert wire.of(None) == LEGACY  # a member that sends no statement: 0.1.0


def test_a_statement_older_than_the_members_record_says_nothing() -> None:
    said = wire.Speaks(nodeId="nod_b", release="0.2.0", wireMin=1, wireMax=2, at=5)
    assert wire.of(said, "0.2.0") == THIS
    assert wire.of(said) == THIS  # no record held yet
    # Rolled back to 0.1.0, which sends no statement: its record names 0.1.0, and the
    # statement its 0.2.0 start left behind no longer counts (the gate closes again).
    assert wire.of(said, "0.1.0") == LEGACY
    assert gate({"a": THIS, "b": wire.of(said, "0.1.0")}, {"x": 2}, mine=THIS).wire == 1


@pytest.mark.parametrize(
    "text", ["", "0.3.0", "0.3.0:", "0.3.0:x-3", ":2-3", "0.3.0:3-2", "0.3.0:0"]
)
def test_a_bad_stand_in_range_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="RELEASE:LOW-HIGH"):
        parse_range(text)


def test_a_stand_in_range_reads() -> None:
    assert parse_range("0.3.0:2-3") == NEXT
    assert parse_range("0.9.0:4") == Range("0.9.0", 4, 4)
