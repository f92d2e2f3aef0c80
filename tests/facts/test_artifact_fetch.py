"""Which piece to ask of which member (`facts.artifact_fetch`, issue 28): rarest first,
bounded per source and in all, a departed source's pieces asked of others, a source that
lies avoided, a restarted fetch resumed from what it holds; and a simulated swarm in which
every fetch completes with each piece verified exactly once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from facts.artifact_fetch import Fetch, from_bitmap, to_bitmap


def test_the_rarest_piece_goes_first_and_the_bounds_hold() -> None:
    fetch = Fetch(count=6, per_source=2, in_flight=3)
    fetch.source_holds("a", range(6))
    fetch.source_holds("b", [0, 1, 2, 3, 4])  # piece 5 is a's alone
    asked = fetch.next()
    assert asked[0] == (5, "a")  # the rarest first
    assert len(asked) == 3  # in flight in all
    assert max(sum(1 for _, s in asked if s == src) for src in "ab") <= 2  # per source
    assert fetch.next() == []  # nothing more until something comes back
    fetch.verified(asked[0][0])
    assert len(fetch.next()) == 1


def test_a_departed_sources_pieces_are_asked_of_the_others() -> None:
    fetch = Fetch(count=4, per_source=4, in_flight=8)
    fetch.source_holds("a", range(4))
    first = dict(fetch.next())
    assert set(first.values()) == {"a"}
    fetch.source_holds("b", range(4))
    assert sorted(fetch.source_gone("a")) == sorted(first)
    again = dict(fetch.next())
    assert sorted(again) == sorted(first)
    assert set(again.values()) == {"b"}


def test_a_source_that_lies_is_avoided_and_its_pieces_fetched_elsewhere() -> None:
    fetch = Fetch(count=5, per_source=5, in_flight=10, strikes=2)
    fetch.source_holds("liar", range(5))
    for piece, source in fetch.next():
        assert source == "liar"
        fetch.refused(piece, source)
    assert fetch.avoided("liar")
    assert fetch.next() == []  # only the liar holds them: nothing is asked of it
    assert fetch.stuck()
    fetch.source_holds("honest", range(5))
    assert {s for _, s in fetch.next()} == {"honest"}  # the control: an honest source


def test_a_network_failure_is_no_strike() -> None:
    fetch = Fetch(count=3, strikes=1)
    fetch.source_holds("a", range(3))
    for piece, source in fetch.next():
        fetch.failed(piece, source)
    assert not fetch.avoided("a")
    assert len(fetch.next()) == 3


def test_a_restarted_fetch_asks_only_for_what_it_lacks() -> None:
    fetch = Fetch(count=10, have={0, 1, 2, 3, 4, 5, 6}, in_flight=10, per_source=10)
    fetch.source_holds("a", range(10))
    assert sorted(p for p, _ in fetch.next()) == [7, 8, 9]


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(min_value=1, max_value=40),
    sources=st.integers(min_value=1, max_value=5),
    seed=st.integers(min_value=0, max_value=2**16),
    lose=st.booleans(),
)
def test_a_swarm_always_completes_each_piece_verified_once(
    count: int, sources: int, seed: int, lose: bool
) -> None:
    rng = random.Random(seed)
    holders = {
        f"s{n}": set(rng.sample(range(count), rng.randint(0, count))) for n in range(sources)
    }
    holders["seed"] = set(range(count))  # one member holds it all
    fetch = Fetch(count=count, per_source=2, in_flight=6, seed=seed)
    for source, held in holders.items():
        fetch.source_holds(source, held)
    verified: list[int] = []
    for _ in range(10 * count + 20):
        asked = fetch.next()
        if not asked and fetch.done:
            break
        for piece, source in asked:
            if lose and source != "seed" and rng.random() < 0.2:
                fetch.source_gone(source)  # a source leaves mid-transfer
                holders.pop(source, None)
                continue
            if source != "seed" and rng.random() < 0.1:
                fetch.refused(piece, source)  # a bad piece
                continue
            if piece not in fetch.have:
                verified.append(piece)
            fetch.verified(piece)
    assert fetch.done, (count, sources)
    assert sorted(verified) == list(range(count))  # each piece verified exactly once


def test_a_bitmap_says_exactly_which_pieces_are_held() -> None:
    for count, held in ((1, set()), (1, {0}), (9, {0, 8}), (1000, set(range(0, 1000, 7)))):
        assert from_bitmap(to_bitmap(held, count), count) == held
    for bad in ("***", to_bitmap({1}, 9)):  # not base64; a bitmap of another size
        with pytest.raises(ValueError, match="bitmap"):
            from_bitmap(bad, 17)


def test_a_busy_source_rests_while_the_others_are_asked() -> None:
    fetch = Fetch(count=4, per_source=1, in_flight=4, seed=3)
    fetch.source_holds("holder", range(4))
    fetch.source_holds("peer", [1, 2])
    asked = dict(fetch.next())
    on_holder = next(p for p, s in asked.items() if s == "holder")
    fetch.busy(on_holder, "holder")  # its link is booked
    assert fetch.resting
    again = fetch.next()
    assert all(s != "holder" for _, s in again)  # it rests: nothing more is asked of it
    assert fetch.avoided("holder") is False  # busy is no strike
    fetch.wake("holder")
    assert not fetch.resting
    assert [s for _, s in fetch.next()] == ["holder"]  # asked again once it wakes


def test_fetchers_seeded_apart_ask_for_different_pieces_first() -> None:
    firsts = set()
    for seed in range(8):
        fetch = Fetch(count=64, per_source=1, in_flight=1, seed=seed)
        fetch.source_holds("holder", range(64))
        firsts.add(fetch.next()[0][0])
    assert len(firsts) > 4  # not all on piece 0: receivers soon have pieces to trade
