"""The one mechanism for signed cluster facts (`facts.signed_set`), tested once on a kind
made up for it (`tests.fixtures.notes`): any delivery order, duplicated, converges; a
tombstone is never undone by an older version; the set stays within its capacity and drops
only what may go; forgetting old tombstones never drops a live fact. Then what the two kinds
in use declare."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from facts.api_keys import ApiKey, KeySet
from facts.deployments import TOMBSTONE_MS, Deployment, DeploymentSet
from facts.signed_set import SignedSet, order
from tests.fixtures.notes import CAPACITY, KEEP_MS, NOTE, Note


def notes_of(names: str) -> st.SearchStrategy[Note]:
    """Versions of notes named from `names`; few values, so they tie often."""
    return st.builds(
        Note,
        name=st.sampled_from(names),
        version=st.integers(1, 4),
        updatedAt=st.integers(0, 100),
        by=st.sampled_from(["nod_a", "nod_b"]),
        gone=st.booleans(),
        expiresAt=st.sampled_from([0, 0, 10, 60]),
    )


def one_content_per_version(offers: list[Note]) -> list[Note]:
    """What members say: a member never signs two versions of a name with the same
    `(version, updatedAt, by)` (each edit is the next version, at its own millisecond), so
    versions equal in the order are one and the same."""
    first: dict[tuple[str, tuple[int, int, str]], Note] = {}
    return [first.setdefault((n.name, order(n)), n) for n in offers]


within_capacity = st.lists(notes_of("abcd"[:CAPACITY]), max_size=30).map(one_content_per_version)
any_names = st.lists(notes_of("abcdefgh"), max_size=40)
now_ms = st.integers(0, 200)


def fill(offers: list[Note], now: int) -> SignedSet[Note]:
    held = SignedSet(NOTE)
    held.merge(offers, now)
    return held


def highest(offers: list[Note]) -> list[Note]:
    """What every member ends with: per name, the version highest in the order."""
    best: dict[str, Note] = {}
    for note in offers:
        if note.name not in best or order(note) > order(best[note.name]):
            best[note.name] = note
    return [n for _, n in sorted(best.items())]


@given(offers=within_capacity, data=st.data(), now=now_ms)
def test_any_delivery_order_duplicated_converges_to_the_highest_versions(
    offers: list[Note], data: st.DataObject, now: int
) -> None:
    again = data.draw(st.lists(st.sampled_from(offers), max_size=10)) if offers else []
    reordered = data.draw(st.permutations([*offers, *again]))
    one, two = fill(offers, now), fill(reordered, now)
    assert one.all() == two.all() == highest(offers)
    assert one.merge(reordered, now) == []  # idempotent: nothing new is taken twice
    assert one.all() == highest(offers)


@given(offers=within_capacity, data=st.data(), now=now_ms)
def test_two_members_exchanging_what_they_hold_agree(
    offers: list[Note], data: st.DataObject, now: int
) -> None:
    cut = data.draw(st.integers(0, len(offers)))
    one, two = fill(offers[:cut], now), fill(offers[cut:], now)
    one.merge(two.all(), now)
    two.merge(one.all(), now)
    assert one.all() == two.all() == highest(offers)


@given(offers=within_capacity, late=st.lists(notes_of("a"), max_size=10))
def test_a_tombstone_is_never_undone_by_an_older_version(
    offers: list[Note], late: list[Note]
) -> None:
    held = fill(offers, 0)
    tombstone = Note(name="a", version=5, updatedAt=0, by="nod_a", gone=True)  # above any offer
    assert held.offer(tombstone, 0)
    assert held.merge(late, 0) == []
    assert held.get("a") == tombstone
    assert "a" not in [n.name for n in held.live()]


@given(offers=any_names, now=now_ms)
def test_the_set_stays_bounded_and_makes_room_only_from_what_may_go(
    offers: list[Note], now: int
) -> None:
    held = SignedSet(NOTE)
    for note in offers:
        before = {n.name: n for n in held.all()}
        was_full = held.full(now)
        taken = held.offer(note, now)
        after = {n.name: n for n in held.all()}
        assert len(held) <= CAPACITY
        for name in before.keys() & after.keys():  # a name held stays or goes up in order
            assert order(after[name]) >= order(before[name])
        for name in before.keys() - after.keys():  # what made room was expired or removed
            dropped = before[name]
            assert NOTE.is_tombstone(dropped) or NOTE.expired(dropped, now)
        assert len(before.keys() - after.keys()) <= 1
        if not taken and note.name not in before:  # a new name is refused only when full
            assert was_full
            assert after == before


@given(offers=any_names, now=now_ms, later=st.integers(0, 400))
def test_forgetting_old_tombstones_never_drops_a_live_fact(
    offers: list[Note], now: int, later: int
) -> None:
    held = fill(offers, now)
    before = held.all()
    forgotten = held.forget_old_tombstones(later)
    after = held.all()
    assert [n for n in before if not n.gone] == [n for n in after if not n.gone]
    assert sorted(forgotten) == [n.name for n in before if n not in after]
    for note in before:
        old = note.gone and later - note.updatedAt > KEEP_MS
        assert (note in after) is not old


def test_each_kind_in_use_declares_its_key_tombstones_and_retention() -> None:
    dep = Deployment(id="dep_" + "0" * 26, name="llama", engine="vllm", updatedAt=0, by="nod_a")
    deployments = DeploymentSet()
    assert deployments.offer(msgspec.structs.replace(dep, deleted=True))
    assert deployments.offer(msgspec.structs.replace(dep, name="chat", deleted=True, updatedAt=9))
    assert deployments.forget_old_tombstones(TOMBSTONE_MS + 1) == ["llama"]  # the older only
    assert [d.name for d in deployments.all()] == ["chat"]

    keys = KeySet()
    revoked = ApiKey(name="team-a", revoked=True, updatedAt=0, by="nod_a")
    assert keys.offer(revoked, 0)
    assert keys.forget_old_tombstones(10**15) == []  # a revoked key is never forgotten by age
    assert keys.get("team-a") == revoked
