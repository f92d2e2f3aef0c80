"""Sharing too few GPUs between elastic deployments (`scheduler.scale.share`, issue 30,
item 3): the GPUs handed out never exceed those free plus those given back, no count leaves
[min, wanted] except downwards to min for a cold deployment, a deployment at zero with
requests waiting goes first and takes a replica from those above their min when nothing is
free, and with room for all every wish is met. A replica counted but not placed (no
room when it was granted) has the free GPUs first, and is cold while it holds none. A
higher priority class goes first and never gives GPUs to a lower one."""

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
        placed = draw(st.one_of(st.none(), st.integers(ready, current + 2)))  # None: all
        priority = draw(st.integers(0, 2))
        made.append(Ask(f"d{n}", gpus, current, wanted, low, ready, waiting, placed, priority))
    return made


@given(asks(), st.integers(0, 12))
def test_never_more_gpus_than_free_and_counts_within_bounds(wishes: list[Ask], free: int) -> None:
    counts = share(wishes, free)
    held = sum(a.current * a.gpus for a in wishes)
    after = sum(counts[a.name] * a.gpus for a in wishes)
    promised = sum((a.current - a.holds) * a.gpus for a in wishes)  # counted, not placed
    leaving = sum(a.releasing * a.gpus for a in wishes)  # placed beyond the count
    assert after - held <= max(free + leaving - promised, 0)  # free, given back or leaving
    for a in wishes:
        assert a.low <= counts[a.name] <= max(a.current, a.wanted)
        if a.wanted < a.current:
            assert counts[a.name] <= a.wanted  # going down is never held up
        if counts[a.name] < min(a.current, a.wanted):  # it yielded: to a cold one, of its
            # class or higher
            assert any(b.cold and counts[b.name] >= 1 and b.priority >= a.priority for b in wishes)


@given(asks())
def test_with_room_for_all_every_wish_is_met(wishes: list[Ask]) -> None:
    room = sum((max(a.wanted - a.current, 0) + a.current - a.holds) * a.gpus for a in wishes)
    room -= min(room, sum(a.releasing * a.gpus for a in wishes))
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


def test_a_replica_counted_but_not_placed_still_gets_room_from_one_above_its_min() -> None:
    # Seen on real agents: the decider counted a GPU free that a replica had just taken
    # (its record had not come), so the cold deployment went to 1 with no room; its count
    # was 1 from then on, and it never took a GPU from the one above its min.
    steady = Ask("steady", 1, 2, 2, 1, 2, 0.0, placed=2)  # both GPUs, min 1
    wanted = Ask("wanted", 1, 1, 1, 0, 0, 1.0, placed=0)  # counted, nowhere to run
    assert wanted.cold
    assert share([steady, wanted], 0) == {"steady": 1, "wanted": 1}
    # The control: once it runs it is no longer cold, and nobody yields more to it.
    running = Ask("wanted", 1, 1, 1, 0, 0, 1.0, placed=1)
    assert share([Ask("steady", 1, 1, 1, 1, 1, 0.0, placed=1), running], 0) == {
        "steady": 1,
        "wanted": 1,
    }
    # A free GPU set aside for a counted replica is not given to another.
    other = Ask("other", 1, 0, 1, 0, 0, 2.0, placed=0)
    assert share([wanted, other], 1) == {"wanted": 1, "other": 0}


def test_the_higher_class_goes_first_and_never_gives_to_a_lower_one() -> None:
    batch = Ask("batch", 1, 0, 1, 0, 0, 50.0, priority=0)  # deep wait, low class
    chat = Ask("chat", 1, 0, 1, 0, 0, 1.0, priority=5)
    assert share([batch, chat], 1) == {"batch": 0, "chat": 1}  # the class before the depth
    # A cold low class takes nothing from a higher class above its min...
    serving = Ask("chat", 1, 2, 2, 0, 2, 0.0, priority=5)
    assert share([serving, batch], 0) == {"chat": 2, "batch": 0}
    # ... and the control: of its own class it does.
    same = Ask("chat", 1, 2, 2, 0, 2, 0.0, priority=0)
    assert share([same, batch], 0) == {"chat": 1, "batch": 1}


def test_gpus_on_their_way_out_cover_a_replica_counted_before_they_went() -> None:
    # One deployment went down a replica (its replica still stops), another was counted one
    # on that GPU: nothing more yields for it while the first one's GPU frees.
    leaving = Ask("leaving", 1, 1, 1, 0, 1, 0.0, placed=2)
    coming = Ask("coming", 1, 1, 1, 0, 0, 3.0, placed=0)  # cold: waits on the GPU above
    serving = Ask("serving", 1, 2, 2, 0, 2, 0.0, placed=2)  # above its min 0
    assert share([leaving, coming, serving], 0) == {"leaving": 1, "coming": 1, "serving": 2}
    # The control: with nothing on its way out, it takes one from above min (by name here).
    gone = Ask("leaving", 1, 1, 1, 0, 1, 0.0, placed=1)
    assert share([gone, coming, serving], 0) == {"leaving": 0, "coming": 1, "serving": 2}
