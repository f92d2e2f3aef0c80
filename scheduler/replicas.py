"""Ranking the replicas of a model for one request, on engine load (issue 13, item 5).
Pure: no I/O, no clock -- the age of each load report is passed in.

A replica can take the request when it serves the model (with the requested engine kind,
if any), its node is reachable and not cordoned, it is `ready`, and it is below its
deployment's `maxInFlight` (when set); the first of these that fails is its reason, in that
order, so a replica of another model is refused for that whatever its node's state.

**At its limit** (`QUEUE_FULL`, 429 when every replica is: the facade's wait line takes the
request) means the requests on the replica reach `max_in_flight`, counted as what this
member has pending there plus what the replica's fresh load report shows beyond that --
others' requests, running or waiting in the engine. Ours are in the report too, so ours
as of the report's reading (`pending_then`, the member keeps its recent changes) come off:
exact for this member, as of the last report (about a second old, a heartbeat more for
another member's replica) for the others. A slot another member frees shows at the next
report, and a burst from another member can pass the limit by what it sent since (the
engine's own queue takes that). No fresh report: ours alone.

Score, higher is better: minus the work per unit of capacity, minus a KV-cache penalty.
Work is what this member sent and has not seen finish (`pending`) plus what the engine
reports running and, weighted more, waiting: a queue means requests sent there now wait
behind it, while running ones share the batch. Pending is counted beside the report even
though the report also holds it, since the report is up to a second old and pending is
what moves between two reads: without it, every request in that second would go to the
same replica. A report older than `STALE_MS` (or none) is unknown, not zero: such a replica
is given the mean reported work of the fresh ones, so it is neither avoided nor flooded for
lack of data, and is scored on its pending above that. Ties go to the lower replica id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from scheduler.refusal import Refusal

__all__ = ["ReplicaRanking", "ReplicaView", "ReportedLoad", "rank_replicas"]

STALE_MS: Final = 5_000
W_RUNNING: Final = 1.0
W_WAITING: Final = 2.0
W_KV: Final = 2.0  # a full cache weighs as much as two more requests
READY: Final = "ready"


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """What an engine said of itself: requests running, waiting, KV-cache share (0-1)."""

    running: float
    waiting: float
    kv_usage: float | None = None

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0:
            raise ValueError(f"negative load {self}")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage {self.kv_usage} is not between 0 and 1")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What ranking needs of a replica: where it runs, its state, its capacity (1.0: one
    replica's worth; 2.0 takes twice the work), and its last load report with its age."""

    replica_id: str
    node_id: str
    model: str
    kind: str = ""
    state: str = READY
    capacity: float = 1.0
    load: ReportedLoad | None = None
    load_age_ms: float | None = None  # None with `load`: never read
    reachable: bool = True
    cordoned: bool = False
    max_in_flight: int = 0  # requests it takes at once (its deployment's maxInFlight); 0: any
    # Whether its deployment, and so its limit, is known here: a member may hold the record
    # that lists a replica a push before the deployment. Until then the replica is counted
    # at its limit -- requests wait in line (the head looks again every second) -- rather
    # than sent to it with no limit at all.
    limit_known: bool = True

    def __post_init__(self) -> None:
        if not self.capacity > 0:
            raise ValueError(f"capacity {self.capacity} of {self.replica_id} is not positive")
        if self.max_in_flight < 0:
            raise ValueError(f"max_in_flight {self.max_in_flight} of {self.replica_id} < 0")

    def fresh_load(self, stale_ms: float) -> ReportedLoad | None:
        """The load report if it is recent enough to trust, else None (unknown)."""
        if self.load is None or self.load_age_ms is None or self.load_age_ms > stale_ms:
            return None
        return self.load


@dataclass(frozen=True, slots=True)
class ReplicaRanking:
    """Replicas that can serve, best first, as (replica id, node id, score); and every
    other replica with the first filter that refused it, by replica id."""

    ranked: list[tuple[str, str, float]]
    refused: list[tuple[str, Refusal]]
    # Each ranked replica's requests per unit of capacity, as `in_use` counts them (ours
    # now, and the others' in its fresh report): what `scheduler.prefix` bounds.
    work: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def best(self) -> tuple[str, str] | None:
        """(replica id, node id) to send to, or None when no replica can take it."""
        return (self.ranked[0][0], self.ranked[0][1]) if self.ranked else None

    def refusal(self) -> Refusal | None:
        """Why no replica can take the request, or None when one can: no replica of the
        model is `MODEL_NOT_SERVED` (404); otherwise the reason of the replica that passed
        the most filters (503)."""
        if self.ranked:
            return None
        order = list(FILTERS)
        reasons = [r for _, r in self.refused if r is not Refusal.MODEL_NOT_SERVED]
        if not reasons:
            return Refusal.MODEL_NOT_SERVED
        return max(reasons, key=order.index)


FILTERS: Final = (
    Refusal.MODEL_NOT_SERVED,
    Refusal.UNREACHABLE,
    Refusal.CORDONED,
    Refusal.REPLICA_NOT_READY,
    Refusal.QUEUE_FULL,  # last: a full replica could serve, so it is the reason that answers
)


def refusal_of(replica: ReplicaView, model: str, engine: str | None) -> Refusal | None:
    """The first filter that refuses `replica` for `model`, or None."""
    if replica.model != model or (engine is not None and replica.kind != engine):
        return Refusal.MODEL_NOT_SERVED
    if not replica.reachable:
        return Refusal.UNREACHABLE
    if replica.cordoned:
        return Refusal.CORDONED
    if replica.state != READY:
        return Refusal.REPLICA_NOT_READY
    return None


def in_use(
    replica: ReplicaView, ours: int, ours_then: int | None = None, stale_ms: float = STALE_MS
) -> float:
    """The requests on `replica` as this member counts them: `ours` now, plus the others'
    in its fresh report -- what the engine ran and queued beyond ours when it was read
    (`ours_then`; unknown: ours now, so the count is the larger of the two)."""
    load = replica.fresh_load(stale_ms)
    if load is None:
        return float(ours)
    then = ours if ours_then is None else ours_then
    return ours + max(0.0, load.running + load.waiting - then)


def reported_work(load: ReportedLoad) -> float:
    """An engine's own figures as work: running, and waiting weighted more."""
    return W_RUNNING * load.running + W_WAITING * load.waiting


def kv_penalty(load: ReportedLoad | None) -> float:
    """Grows with the square of the KV share: a half-full cache costs little, a full one
    (preemptions, recomputation) costs `W_KV` requests."""
    if load is None or load.kv_usage is None:
        return 0.0
    return W_KV * load.kv_usage**2


def rank_replicas(
    model: str,
    replicas: Iterable[ReplicaView],
    pending_by_replica: Mapping[str, int],
    *,
    engine: str | None = None,
    stale_ms: float = STALE_MS,
    pending_then: Callable[[str, float], int] | None = None,
) -> ReplicaRanking:
    """Filter and score every replica for a request for `model` (and `engine`, a kind);
    `pending_then(replica, age_ms)` is this member's pending there that long ago."""
    eligible: list[ReplicaView] = []
    refused: list[tuple[str, Refusal]] = []
    requests: dict[str, float] = {}  # replica -> the requests on it, ours and the others'
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        reason = refusal_of(replica, model, engine)
        if reason is None:
            ours = pending_by_replica.get(replica.replica_id, 0)
            age = replica.load_age_ms
            then = pending_then(replica.replica_id, age) if pending_then and age else None
            on_it = requests[replica.replica_id] = in_use(replica, ours, then, stale_ms)
            if not replica.limit_known or (
                replica.max_in_flight and on_it >= replica.max_in_flight
            ):
                reason = Refusal.QUEUE_FULL
        if reason is None:
            eligible.append(replica)
        else:
            refused.append((replica.replica_id, reason))
    fresh = [r.fresh_load(stale_ms) for r in eligible]
    known = [reported_work(f) / r.capacity for r, f in zip(eligible, fresh, strict=True) if f]
    unknown_work = sum(known) / len(known) if known else 0.0
    scored = []
    work = {}
    for replica, load in zip(eligible, fresh, strict=True):
        pending = max(0, pending_by_replica.get(replica.replica_id, 0)) / replica.capacity
        reported = reported_work(load) / replica.capacity if load else unknown_work
        work[replica.replica_id] = requests[replica.replica_id] / replica.capacity
        score = -(pending + reported) - kv_penalty(load)
        scored.append((replica.replica_id, replica.node_id, score))
    scored.sort(key=lambda s: (-s[2], s[0]))
    return ReplicaRanking(ranked=scored, refused=refused, work=work)
