"""How many replicas a deployment wants, from its load (issue 30, item 1). Pure: no I/O, no
clock -- the samples and the time are passed in.

A deployment with bounds (`min`, `max`) and a policy is sampled about once a second from
the view every member shares: its ready replicas, the requests its engines run, and the
requests that wait -- in the engines' queues and in the members' wait lines. `decide` turns
the samples of the last few minutes, the desired count now, when it last changed, how many
more replicas the free GPUs hold, and what one replica is known to run at once into the
next desired count and why:

- **Bounds first.** A desired count outside the bounds moves inside them (`bounds`).
- **Up fast, on waiting** (`waiting`). When more than `target_waiting` requests per ready
  replica wait (any request, at zero replicas), the deployment wants enough replicas to run
  what waits beyond that: one more replica for every `capacity` requests (what one replica
  is known to run at once), or one more at a time while that is unknown. Replicas already
  wanted and not ready yet count: requests that go on waiting during a cold start ask for
  nothing more, so a burst at zero makes one scale-up, not one per request. Above zero,
  the requests must have waited for `SETTLE_S` with the same replicas ready: when a
  replica has just become ready, what waited for it is still draining (and the members'
  reports of their wait lines are a heartbeat old), which is no reason for one more.
  Never above `max`, never more than the free GPUs hold (`no room` when they hold none).
- **Down slowly, on quiet** (`quiet`). Only when no request waited for the whole
  `scale_down_after_s`, the last change is at least that old, and the samples cover it: to
  as few replicas as ran the window's peak at `HEADROOM` of the known capacity, one replica
  a window at most; while the capacity is unknown, one replica a window, never the last
  one while requests run.
- **To zero when idle** (`idle`). With `min` 0, a deployment that ran nothing and had
  nothing waiting for `idle_to_zero_s` wants no replica.

**The capacity** is learned: whenever requests wait, the engines are full, and the requests
running per ready replica is what one replica runs at once. The latest such reading is the
capacity (`Decision.capacity`): the caller keeps it and passes it back, so a deployment that
once filled does not step down into a count that fills again. Under a constant load the
count therefore settles and stays: up to what runs it without waiting, never down below
what its peak needs at `HEADROOM` -- no oscillation.

Every member that holds the same samples computes the same count; the caller carries out
one member's decision (`scheduler.scale` does not say which).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "HEADROOM",
    "SETTLE_S",
    "Ask",
    "Bounds",
    "Decision",
    "LoadSample",
    "ScalePolicy",
    "decide",
    "share",
]

HEADROOM: Final = 0.8  # scale down only to counts whose peak stays under 80 % of capacity
SETTLE_S: Final = 3.0  # above zero, requests wait this long, same replicas ready, to add one

Reason = Literal["bounds", "waiting", "no room", "quiet", "idle", "steady", "yielded"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """The fewest and the most replicas a deployment may have."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"bounds {self.low}..{self.high}: need 0 <= min <= max")

    def clamp(self, count: int) -> int:
        """`count` moved inside the bounds."""
        return max(self.low, min(self.high, count))


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """When to add replicas and when to take them away."""

    target_waiting: float = 0.0  # requests per ready replica that may wait before adding
    scale_down_after_s: float = 300.0  # quiet this long before a replica goes
    idle_to_zero_s: float = 900.0  # idle this long before the last one goes (min 0)

    def __post_init__(self) -> None:
        if self.target_waiting < 0:
            raise ValueError("target_waiting must be 0 or more")
        if self.scale_down_after_s <= 0 or self.idle_to_zero_s <= 0:
            raise ValueError("scale_down_after_s and idle_to_zero_s must be positive")


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The deployment's load at `at_s`: replicas ready, requests their engines run, and
    requests waiting (the engines' queues and the members' wait lines)."""

    at_s: float
    ready: int
    running: float
    waiting: float

    def __post_init__(self) -> None:
        if self.ready < 0 or self.running < 0 or self.waiting < 0:
            raise ValueError(f"negative load {self}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The desired count, why, and what one replica is known to run at once (None:
    unknown yet)."""

    desired: int
    reason: Reason
    capacity: float | None


def decide(
    history: Sequence[LoadSample],
    *,
    current: int,
    bounds: Bounds,
    policy: ScalePolicy,
    now_s: float,
    changed_at_s: float,
    room: int,
    capacity: float | None = None,
) -> Decision:
    """The next desired count from `history` (oldest first, the latest last), the count now
    (`current`, changed at `changed_at_s`), the replicas the free GPUs hold more (`room`)
    and the capacity known so far."""
    capacity = _learned(history, capacity)
    wanted = bounds.clamp(current)
    if wanted != current:
        return Decision(wanted, "bounds", capacity)
    if not history:
        return Decision(current, "steady", capacity)
    latest = history[-1]
    if latest.waiting > policy.target_waiting * latest.ready or (
        current == 0 and latest.waiting > 0
    ):
        if current > 0 and not _waited(history, policy, now_s):
            return Decision(current, "steady", capacity)  # draining into what just came up
        excess = latest.waiting - policy.target_waiting * latest.ready
        extra = math.ceil(excess / capacity) if capacity else 1
        need = bounds.clamp(latest.ready + max(1, extra))
        if need > current:
            grown = min(need, current + max(0, room))
            return Decision(grown, "waiting" if grown > current else "no room", capacity)
        return Decision(current, "steady", capacity)  # what is starting will take it
    return _down(history, current, bounds, policy, now_s, changed_at_s, capacity)


def _waited(history: Sequence[LoadSample], policy: ScalePolicy, now_s: float) -> bool:
    """Whether requests waited beyond the target in every sample of the last `SETTLE_S`,
    with the same replicas ready throughout (and the samples reach back that far)."""
    window = _since(history, now_s - SETTLE_S)
    if window is None:
        return False
    ready = window[-1].ready
    return all(s.ready == ready and s.waiting > policy.target_waiting * s.ready for s in window)


def _learned(history: Sequence[LoadSample], capacity: float | None) -> float | None:
    # The latest reading of a full replica: requests waited, so each ran what it could.
    for sample in reversed(history):
        if sample.waiting > 0 and sample.ready > 0 and sample.running > 0:
            return sample.running / sample.ready
    return capacity


def _down(
    history: Sequence[LoadSample],
    current: int,
    bounds: Bounds,
    policy: ScalePolicy,
    now_s: float,
    changed_at_s: float,
    capacity: float | None,
) -> Decision:
    steady = Decision(current, "steady", capacity)
    if current <= bounds.low or now_s - changed_at_s < policy.scale_down_after_s:
        return steady
    window = _since(history, now_s - policy.scale_down_after_s)
    if window is None or any(s.waiting > 0 for s in window):
        return steady
    if bounds.low == 0:
        idle = _since(history, now_s - policy.idle_to_zero_s)
        if idle is not None and all(s.running == 0 and s.waiting == 0 for s in idle):
            return Decision(0, "idle", capacity)
    peak = max(s.running for s in window)
    if capacity:
        fits = max(1, math.ceil(peak / (capacity * HEADROOM))) if peak else 1
        if fits >= current:
            return steady
        return Decision(bounds.clamp(max(fits, current - 1)), "quiet", capacity)
    if current <= 1:
        return steady  # the last replica goes only when idle (`idle_to_zero_s`)
    return Decision(bounds.clamp(current - 1), "quiet", capacity)


def _since(history: Sequence[LoadSample], start_s: float) -> list[LoadSample] | None:
    """The samples from `start_s` on, or None when the history does not reach back that far
    (a member that started sampling lately does not decide on less)."""
    if not history or history[0].at_s > start_s:
        return None
    return [s for s in history if s.at_s >= start_s]


@dataclass(frozen=True, slots=True)
class Ask:
    """One elastic deployment's wish, for sharing GPUs: its count now, what `decide`
    wants with room aside, its min, GPUs per replica, its load, and how many of its
    replicas hold GPUs now (`placed`, any state; None: every one counted)."""

    name: str
    gpus: int
    current: int
    wanted: int
    low: int
    ready: int
    waiting: float
    placed: int | None = None
    priority: int = 0  # its class: higher first, and never a donor to a lower one

    @property
    def holds(self) -> int:
        """Replicas of its count that hold their GPUs (the rest wait for room)."""
        return self.current if self.placed is None else min(self.placed, self.current)

    @property
    def releasing(self) -> int:
        """Replicas placed beyond its count: on their way out, their GPUs free soon."""
        return 0 if self.placed is None else max(self.placed - self.current, 0)

    @property
    def cold(self) -> bool:
        """Nothing holds GPUs for it and requests wait: served by nothing until a replica
        of it gets room (at zero, or counted but not placed)."""
        return self.holds == 0 and self.waiting > 0

    @property
    def depth(self) -> float:
        """Requests waiting per ready replica (all of them at zero)."""
        return self.waiting / max(1, self.ready)


def share(asks: Sequence[Ask], free_gpus: int) -> dict[str, int]:
    """Each deployment's count when the free GPUs may not hold every scale-up.

    The rule (docs/deployments.md, "Sharing GPUs"): replicas counted but not yet placed
    have the free GPUs first (they were granted), and those of replicas on their way out
    count for them. What goes down goes first, and its GPUs
    are free. Then the deployments that want more take one replica a turn, in order: the
    higher priority class first, then those cold (requests waiting, nothing placed), then
    the deepest wait per ready replica, then by name; a turn is skipped by one whose
    replica does not fit. A cold deployment whose replica still has no room takes GPUs from
    deployments of its class or lower above their min, the lower class and then the
    shallowest wait first, one replica at a time, down to their min at most -- so a cold
    deployment waits at most one decision for a replica whenever the replicas above min
    elsewhere hold its GPUs. Deployments without GPUs take what they want."""
    counts = {a.name: a.current for a in asks}
    # Granted and not placed: theirs already (negative when they do not all fit); replicas
    # on their way out (placed beyond their count) free theirs for those first.
    free = free_gpus + sum((a.releasing - (a.current - a.holds)) * a.gpus for a in asks)
    for a in asks:
        if a.wanted < a.current:  # down first: its GPUs are free for the others
            counts[a.name] = a.wanted
            free += (a.current - a.wanted) * a.gpus
        elif a.gpus == 0:
            counts[a.name] = a.wanted
    growing = sorted(
        (a for a in asks if a.wanted > a.current and a.gpus > 0),
        key=lambda a: (-a.priority, not a.cold, -a.depth, a.name),
    )
    while True:
        took = False
        for a in growing:
            if counts[a.name] < a.wanted and a.gpus <= free:
                counts[a.name] += 1
                free -= a.gpus
                took = True
        if not took:
            break
    donors = sorted(
        (a for a in asks if a.gpus > 0 and not a.cold),
        key=lambda a: (a.priority, a.depth, a.name),
    )
    cold = sorted(
        (a for a in asks if a.cold and a.gpus > 0 and max(a.wanted, counts[a.name]) > 0),
        key=lambda a: (-a.priority, -a.depth, a.name),
    )
    for a in cold:
        # Room for one replica: a new one at zero needs its GPUs free; one counted but not
        # placed had them set aside above, so it needs the free count not below zero.
        need = a.gpus if counts[a.name] == 0 else 0
        if free >= need:
            if counts[a.name] == 0:
                counts[a.name] = 1
                free -= a.gpus
            continue
        givers = [d for d in donors if d.priority <= a.priority]  # never a higher class
        spare = sum((counts[d.name] - d.low) * d.gpus for d in givers if counts[d.name] > d.low)
        if free + spare < need:
            continue  # not even every replica above min elsewhere would hold one
        for donor in givers:
            while free < need and counts[donor.name] > donor.low:
                counts[donor.name] -= 1
                free += donor.gpus
            if free >= need:
                break
        if counts[a.name] == 0:
            counts[a.name] = 1
            free -= a.gpus
    return counts
