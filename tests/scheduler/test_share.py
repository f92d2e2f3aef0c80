"""Sharing too few GPUs between elastic deployments (`scheduler.scale.share`, issue 30,
item 3): the GPUs handed out never exceed those free plus those given back, no count leaves
[min, wanted] except downwards to min for a cold deployment, a deployment at zero with
requests waiting goes first and takes a replica from those above their min when nothing is
free, and with room for all every wish is met."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.scale import Ask, share


@st.composite
def asks(draw: st.DrawFn) -> list[Ask]:
    made = []
    for n in range(draw(st.integers(1, 5))):
        low = draw(st.integers(0, 2))
        current = draw(st.integers(low, 4))
        wanted = draw(st.integers(low, 6))
        ready = draw(st.integers(0, current))
        gpus = draw(st.integers(0, 4))
        waiting = draw(st.sampled_from([0.0, 1.0, 5.0, 40.0]))
        made.append(Ask(f"d{n}", gpus, current, wanted, low, ready, waiting))
    return made


@given(asks(), st.integers(0, 12))
def test_never_more_gpus_than_free_and_counts_within_bounds(wishes: list[Ask], free: int) -> None:
    counts = share(wishes, free)
    held = sum(a.current * a.gpus for a in wishes)
    after = sum(counts[a.name] * a.gpus for a in wishes)
    assert after - held <= free  # what it hands out was free or given back
    for a in wishes:
        assert a.low <= counts[a.name] <= max(a.current, a.wanted)
        if a.wanted < a.current:
            assert counts[a.name] == a.wanted  # going down is never held up
        if counts[a.name] < min(a.current, a.wanted):  # it yielded: only to a cold one
            assert any(b.cold and counts[b.name] == 1 for b in wishes)


@given(asks())
def test_with_room_for_all_every_wish_is_met(wishes: list[Ask]) -> None:
    room = sum(max(a.wanted - a.current, 0) * a.gpus for a in wishes)
    assert share(wishes, room) == {a.name: a.wanted for a in wishes}


def test_the_cold_one_goes_first_then_the_deepest_wait() -> None:
    cold = Ask("cold", 1, 0, 2, 0, 0, 3.0)
    deep = Ask("deep", 1, 1, 3, 1, 1, 30.0)
    shallow = Ask("shallow", 1, 1, 3, 1, 1, 4.0)
    assert share([shallow, deep, cold], 2) == {"cold": 1, "deep": 2, "shallow": 1}
    # One a turn, in that order: the fourth GPU goes to cold again, not to deep.
    assert share([shallow, deep, cold], 4) == {"cold": 2, "deep": 2, "shallow": 2}


def test_a_cold_deployment_takes_a_replica_from_one_above_its_min() -> None:
    busy = Ask("busy", 2, 3, 3, 1, 3, 0.0)  # three replicas, min 1, nothing waits
    deep = Ask("deep", 2, 2, 2, 2, 2, 9.0)  # at its min: never a donor
    cold = Ask("cold", 2, 0, 1, 0, 0, 5.0)
    assert share([busy, deep, cold], 0) == {"busy": 2, "deep": 2, "cold": 1}
    # The control: with nothing above min elsewhere, it waits and nobody yields.
    at_min = Ask("busy", 2, 1, 1, 1, 1, 0.0)
    assert share([at_min, deep, cold], 0) == {"busy": 1, "deep": 2, "cold": 0}
