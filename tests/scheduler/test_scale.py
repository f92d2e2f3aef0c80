"""The scaling function (`scheduler.scale`, issue 30, item 1) against a simulated
deployment: replicas that take a while to start and run a fixed number of requests at
once, a load given as requests in flight. Properties: never outside the bounds; under a
constant load the count settles and stays (at most one turn, from down to up, while the
capacity is still unknown); after a step it converges within a bounded time; a burst at
zero asks for one replica, not one per request; idle goes to zero only after the idle
period."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.scale import SETTLE_S, Bounds, Decision, LoadSample, ScalePolicy, decide

POLICY = ScalePolicy(target_waiting=0.0, scale_down_after_s=30.0, idle_to_zero_s=90.0)


class Deployment:
    """Replicas that start `start_s` after they are wanted and run `per_replica` requests
    at once; a decision a second."""

    def __init__(
        self, bounds: Bounds, *, per_replica: int, start_s: int, current: int, room: int = 64
    ) -> None:
        self.bounds = bounds
        self.per_replica = per_replica
        self.start_s = start_s
        self.desired = current
        self.ready = current
        self.starting: deque[int] = deque()  # when each wanted replica becomes ready
        self.history: deque[LoadSample] = deque()
        self.changed_at = -1000.0
        self.capacity: float | None = None
        self.room = room
        self.counts: list[int] = []
        self.decisions: list[Decision] = []

    def run(self, load: Callable[[int], float], seconds: int, start: int = 0) -> None:
        for now in range(start, start + seconds):
            while self.starting and self.starting[0] <= now:
                self.starting.popleft()
                self.ready += 1
            self.ready = min(self.ready, self.desired)  # a replica taken away goes at once
            demand = load(now)
            running = min(demand, self.ready * self.per_replica)
            self.history.append(LoadSample(now, self.ready, running, demand - running))
            while self.history[0].at_s < now - POLICY.idle_to_zero_s - 1:
                self.history.popleft()
            made = decide(
                list(self.history),
                current=self.desired,
                bounds=self.bounds,
                policy=POLICY,
                now_s=now,
                changed_at_s=self.changed_at,
                room=self.room,
                capacity=self.capacity,
            )
            self.decisions.append(made)
            self.capacity = made.capacity
            if made.desired != self.desired:
                self.changed_at = now
                wanted_more = made.desired - (self.ready + len(self.starting))
                for _ in range(max(0, wanted_more)):
                    self.starting.append(now + self.start_s)
                while self.ready + len(self.starting) > made.desired and self.starting:
                    self.starting.pop()
                self.desired = made.desired
            self.counts.append(self.desired)


def turns(counts: list[int]) -> int:
    """How often the count changed direction."""
    moves = [b - a for a, b in itertools.pairwise(counts) if b != a]
    return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))


bounds_st = st.tuples(st.integers(0, 4), st.integers(0, 8)).map(
    lambda t: Bounds(min(t), max(t[1], t[0], 1))
)


@settings(max_examples=60, deadline=None)
@given(
    bounds=bounds_st,
    per_replica=st.integers(1, 16),
    load=st.integers(0, 120),
    start_s=st.integers(1, 20),
    current=st.integers(0, 8),
)
def test_a_constant_load_settles_and_stays_within_the_bounds(
    bounds: Bounds, per_replica: int, load: int, start_s: int, current: int
) -> None:
    deployment = Deployment(
        bounds, per_replica=per_replica, start_s=start_s, current=bounds.clamp(current)
    )
    deployment.run(lambda now: float(load), 900)
    counts = deployment.counts
    assert all(bounds.low <= c <= bounds.high for c in counts)
    assert turns(counts) <= 1, counts  # one turn at most: down, until it learns, then up
    settled = counts[-300:]
    assert len(set(settled)) == 1, settled  # and then it stays
    final = settled[0]
    needed = math.ceil(load / per_replica)
    if load and needed <= bounds.high:
        assert final >= needed  # what runs the load without waiting
        assert final <= max(bounds.low, math.ceil(load / (per_replica * 0.8)) + 1)
    if not load:
        assert final == bounds.low  # idle: down to the floor


@settings(max_examples=40, deadline=None)
@given(
    before=st.integers(0, 60),
    after=st.integers(0, 60),
    per_replica=st.integers(2, 8),
    start_s=st.integers(1, 10),
)
def test_after_a_step_the_count_converges_within_a_bound(
    before: int, after: int, per_replica: int, start_s: int
) -> None:
    bounds = Bounds(0, 16)
    deployment = Deployment(bounds, per_replica=per_replica, start_s=start_s, current=0)
    deployment.run(lambda now: float(before), 400)
    deployment.run(lambda now: float(after), 900, start=400)
    needed = min(bounds.high, math.ceil(after / per_replica))
    # Up: within a start and a few decisions per replica. Down: a replica a window, then
    # the idle period for the last one.
    steps = abs(deployment.counts[399] - needed) + 1
    bound_s = start_s * steps + POLICY.scale_down_after_s * (steps + 1) + POLICY.idle_to_zero_s
    settled_at = 400 + int(bound_s)
    tail = deployment.counts[settled_at:]
    assert len(set(tail)) == 1, (deployment.counts[399], tail[:5])
    assert tail[0] >= needed


def test_a_burst_at_zero_asks_for_one_replica_not_one_per_request() -> None:
    deployment = Deployment(Bounds(0, 4), per_replica=64, start_s=15, current=0)
    deployment.run(lambda now: 20.0 if now >= 5 else 0.0, 60)
    ups = [d for d in deployment.decisions if d.reason == "waiting"]
    assert len(ups) == 1  # one scale-up while the replica starts, whatever waits meanwhile
    assert deployment.counts[-1] == 1  # one replica runs the 20 at once


def test_idle_goes_to_zero_only_after_the_idle_period_and_comes_back_on_a_request() -> None:
    deployment = Deployment(Bounds(0, 4), per_replica=8, start_s=5, current=2)
    deployment.run(lambda now: 0.0, 200)
    zero_at = deployment.counts.index(0)
    assert zero_at >= POLICY.idle_to_zero_s  # not before the idle period
    reasons = [d.reason for d in deployment.decisions if d.reason != "steady"]
    assert reasons[-1] == "idle"
    deployment.run(lambda now: 1.0, 30, start=200)
    assert deployment.counts[-1] == 1  # a request at zero brings one back


def test_no_room_holds_the_count_and_says_so() -> None:
    deployment = Deployment(Bounds(1, 8), per_replica=4, start_s=1, current=1, room=0)
    deployment.run(lambda now: 40.0, 20)
    assert deployment.counts[-1] == 1
    assert deployment.decisions[-1].reason == "no room"


def test_bounds_move_the_count_inside_them_first() -> None:
    made = decide(
        [],
        current=9,
        bounds=Bounds(1, 4),
        policy=POLICY,
        now_s=0.0,
        changed_at_s=0.0,
        room=10,
    )
    assert (made.desired, made.reason) == (4, "bounds")


def test_a_replica_just_ready_is_given_settle_s_before_one_more() -> None:
    bounds = Bounds(1, 4)

    def at(now: float, history: list[LoadSample]) -> Decision:
        return decide(
            history, current=1, bounds=bounds, policy=POLICY, now_s=now, changed_at_s=0, room=8
        )

    starting = [LoadSample(t, 0, 0, 20) for t in range(10)]  # it waited for the cold start
    draining = [*starting, LoadSample(10, 1, 4, 16)]  # ready now: what waited drains into it
    assert at(10, draining) == Decision(1, "steady", 4.0)  # not one more yet
    still = draining + [LoadSample(t, 1, 4, 16) for t in range(11, 11 + int(SETTLE_S))]
    assert at(still[-1].at_s, still).desired > 1  # waiting went on with it ready: one more
    drained = [*draining, *(LoadSample(t, 1, 4, 0) for t in range(11, 15))]
    assert at(14, drained).desired == 1  # the control: it drained, nothing more
