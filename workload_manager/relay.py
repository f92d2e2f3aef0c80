"""The relay and dedup core of the workload manager, sans-I/O.

`RelayCore` takes decoded lifecycle and removal events -- from the local broker or from a
peer -- and returns what to do with them: deliver to the broker, send to peers, or drop
(with the reason). It keeps the latest record per workload and nothing per event, so its
memory is bounded by live workloads plus a retention window of finished and removed ones.
Time is passed in (`now`, seconds on a monotonic clock) so tests use a fake clock.

The rules (seed 002, docs/protocol.md):

- The dedup key is `(runId, id, seq)`: an event is new iff its `seq` is above the highest
  seen for `(runId, id)`. `runId` is in the key because `id` is a per-facade counter that
  restarts at 1; `seq` is in it so a workload that returns to a placement it already had
  is not mistaken for a redelivery.
- `workloads:remove` names `(originatedFrom, workloadId)` and no `runId`, so it removes every
  record under that pair and leaves a tombstone on the pair: while the tombstone lives, no
  late, duplicated or reordered event of any run brings the workload back. Every member
  applies the same rule whatever order events arrive in, so all of them converge on the same
  view (the trade-off, a reused id hidden for the retention, is in docs/protocol.md).
- Local events go to the peers and are not echoed to the broker; first-seen remote events
  go to the broker once and on to the peers, never the sender or the origin (which of the
  others -- one ring successor, or all with NVPAIR_WM_RELAY=flood -- is the broadcaster's
  choice: docs/protocol.md, "Relay").
- A node's own jobs are its own: only it writes their events, and no honest peer sends them
  back to it (the relay excludes the origin, catch-up and anti-entropy leave them out). A
  peer's record or removal claiming `originatedFrom` == this node (`own_id`) is a forgery --
  taken, it would overwrite or pin this node's own job -- so it is dropped and counted.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final

from msgspec import Struct

from workload_manager.errors import ConfigurationError
from workload_manager.workload import Workload, WorkloadRemoval, WorkloadState

__all__ = [
    "PROBE_MAX",
    "Action",
    "DeliverToBroker",
    "Drop",
    "DropReason",
    "Event",
    "RelayCore",
    "RelayCounters",
    "SendToPeers",
]

_Key = tuple[str, str]  # (runId, id)
_Pair = tuple[str, str]  # (originatedFrom, id)


# A lifecycle event is its record: the method follows from the state (METHOD_FOR_STATE),
# checked once where the frame is decoded.
Event = Workload | WorkloadRemoval


class DeliverToBroker(Struct, frozen=True, gc=False):
    """Tell the broker: `workloads:upsert` for a record, `workloads:remove` for a removal."""

    event: Event


class SendToPeers(Struct, frozen=True, gc=False):
    """Send the event on: a local one (`exclude` empty) to every peer; a relayed one to
    the peers the broadcaster picks, never those in `exclude` (its sender and origin)."""

    event: Event
    exclude: tuple[str, ...]


class DropReason(enum.Enum):
    """Why an event was not passed on."""

    DUPLICATE = "duplicate"  # same seq as the latest seen
    STALE = "stale"  # lower seq than the latest seen
    REMOVED = "removed"  # the workload was removed; a tombstone holds it down
    OWN_ORIGIN = "own origin"  # a peer's event claiming to originate from this node


class Drop(Struct, frozen=True, gc=False):
    """The event is not passed on."""

    reason: DropReason


Action = DeliverToBroker | SendToPeers | Drop

_DROPPED_DUPLICATE: Final = (Drop(DropReason.DUPLICATE),)
_DROPPED_STALE: Final = (Drop(DropReason.STALE),)
_DROPPED_REMOVED: Final = (Drop(DropReason.REMOVED),)
_DROPPED_OWN_ORIGIN: Final = (Drop(DropReason.OWN_ORIGIN),)
_NO_EXCLUDE: Final[tuple[str, ...]] = ()
# A removal looks up its id under each run of its origin while the origin has at most this
# many runs (a facade's starts within the retention); past it, under the origin's index by id.
PROBE_MAX: Final = 64
_TERMINAL: Final = tuple(state for state in WorkloadState if state.is_terminal)


@dataclass(slots=True)
class RelayCounters:
    """What the relay has seen, for `manager:status` and metrics."""

    received_local: int = 0
    received_remote: int = 0
    accepted: int = 0
    duplicates: int = 0
    stale: int = 0
    blocked_by_tombstone: int = 0
    removals: int = 0
    duplicate_removals: int = 0
    pruned: int = 0
    evicted: int = 0
    own_origin: int = 0  # peers' events claiming this node as their origin, dropped


class RelayCore:
    """Dedup state and routing decisions for workload events."""

    __slots__ = (
        "_arrivals",
        "_by_id",
        "_finished_at",
        "_latest",
        "_removed_at",
        "_runs",
        "counters",
        "max_workloads",
        "own_id",
        "probe_max",
        "retention_s",
    )

    def __init__(
        self,
        *,
        retention_s: float = 3600.0,
        max_workloads: int = 100_000,
        probe_max: int = PROBE_MAX,
    ) -> None:
        if retention_s < 0 or max_workloads < 1 or probe_max < 1:
            raise ConfigurationError("retention_s must be >= 0, max_workloads and probe_max >= 1")
        self.retention_s = retention_s
        self.max_workloads = max_workloads
        self.probe_max = probe_max
        self.counters = RelayCounters()
        # This node's id, once it has one (the manager sets it): peers' events claiming it as
        # their origin are dropped.
        self.own_id: str | None = None
        self._latest: dict[_Key, Workload] = {}
        # For removals, which name (originatedFrom, id) and no runId: each origin's runIds
        # and how many records each has here. A runId is a facade's nonce per start, so an
        # origin has a few, and keeping this costs a lookup in a small dict per new record
        # (an index per (originatedFrom, id) cost one in a dict as large as `_latest`). A
        # removal looks up its id under each run of its origin -- but under an origin with
        # more than `probe_max` runs (a member making up runIds to make removals costly) it
        # reads that origin's own index by id, made once and kept until the origin's last
        # record goes.
        self._runs: dict[str, dict[str, int]] = {}
        self._by_id: dict[str, dict[str, tuple[str, ...]]] = {}
        # FIFOs are OrderedDicts: taking the oldest entry of a plain dict after many
        # deletions from its front costs a scan over the deleted slots.
        self._finished_at: OrderedDict[_Key, float] = OrderedDict()  # terminal, oldest first
        self._removed_at: OrderedDict[_Pair, float] = OrderedDict()  # tombstones, oldest first
        self._arrivals: deque[_Key] = deque()  # every key in order of arrival, for the cap

    # -- inbound ------------------------------------------------------------------------

    def receive_local(self, event: Event, now: float) -> tuple[Action, ...]:
        """An event from our own broker: broadcast it if it is new."""
        return self.receive(event, now, None)

    def receive_remote(self, event: Event, sender: str, now: float) -> tuple[Action, ...]:
        """An event from peer `sender`: tell the broker once and relay it onwards."""
        return self.receive(event, now, sender)

    def receive(self, event: Event, now: float, sender: str | None) -> tuple[Action, ...]:
        """An event from our broker (`sender` None) or from a peer; returns what to do."""
        if type(event) is Workload:
            drop = self.take(event, now, sender)
            if drop is not None:
                return drop
            if sender is None:
                return (SendToPeers(event, _NO_EXCLUDE),)
            return (DeliverToBroker(event), SendToPeers(event, (sender, event.originatedFrom)))
        assert type(event) is WorkloadRemoval
        counters = self.counters
        if sender is None:
            counters.received_local += 1
        else:
            counters.received_remote += 1
            if event.originatedFrom == self.own_id:
                counters.own_origin += 1
                return _DROPPED_OWN_ORIGIN
        drop = self._remove((event.originatedFrom, event.workloadId), now)
        if drop is not None:
            return drop
        if sender is None:
            return (SendToPeers(event, _NO_EXCLUDE),)
        return (DeliverToBroker(event), SendToPeers(event, (sender, event.originatedFrom)))

    def take(self, workload: Workload, now: float, sender: str | None) -> tuple[Drop] | None:
        """`receive` for a record, without building its actions: None when it is new (the
        broker gets it once if it came from a peer, and the peers get it, never its sender
        or origin), else why it is dropped. The manager's hot path calls this directly.

        This runs once per event on every member, so the common case -- a lifecycle record,
        new or a duplicate -- is kept to a handful of dict operations in one function.
        """
        counters = self.counters
        if sender is None:
            counters.received_local += 1
        else:
            counters.received_remote += 1
            if workload.originatedFrom == self.own_id:
                counters.own_origin += 1
                return _DROPPED_OWN_ORIGIN
        if self._removed_at and (workload.originatedFrom, workload.id) in self._removed_at:
            counters.blocked_by_tombstone += 1
            return _DROPPED_REMOVED
        key = (workload.runId, workload.id)
        latest = self._latest
        previous = latest.get(key)
        if previous is None:
            runs = self._runs.get(workload.originatedFrom)
            if runs is None:
                self._runs[workload.originatedFrom] = {workload.runId: 1}
            else:
                runs[workload.runId] = runs.get(workload.runId, 0) + 1
            if self._by_id:
                self._index(workload)
            arrivals = self._arrivals
            arrivals.append(key)
            if len(arrivals) > 2 * len(latest) + 1024:
                # Keys forgotten since they arrived: drop them, keeping the order.
                self._arrivals = deque(k for k in arrivals if k in latest)
        elif workload.seq <= previous.seq:
            if workload.seq == previous.seq:
                counters.duplicates += 1
                return _DROPPED_DUPLICATE
            counters.stale += 1
            return _DROPPED_STALE
        else:
            if previous.state in _TERMINAL:
                del self._finished_at[key]
            if previous.originatedFrom != workload.originatedFrom:
                # A record naming another origin for a held key (a forgery: a job's origin
                # never changes): counted where it now says, so a removal finds it there.
                self._uncount(previous)
                runs = self._runs.setdefault(workload.originatedFrom, {})
                runs[workload.runId] = runs.get(workload.runId, 0) + 1
                self._index(workload)
        latest[key] = workload
        if workload.state in _TERMINAL:
            self._finished_at[key] = now
        counters.accepted += 1
        if len(latest) > self.max_workloads:
            self._evict_one()
        return None

    # -- views ----------------------------------------------------------------------------

    @property
    def live_count(self) -> int:
        """Records held (not removed), finished ones within retention included."""
        return len(self._latest)

    @property
    def tombstone_count(self) -> int:
        """Removed `(originatedFrom, id)` pairs held down by a tombstone."""
        return len(self._removed_at)

    def latest(self, run_id: str, workload_id: str) -> Workload | None:
        """The latest record held for a workload, if any."""
        return self._latest.get((run_id, workload_id))

    def is_removed(self, originated_from: str, workload_id: str) -> bool:
        """Whether a tombstone holds this workload down."""
        return (originated_from, workload_id) in self._removed_at

    def view(self) -> tuple[list[Workload], list[WorkloadRemoval]]:
        """The latest record per workload and the removals: what catch-up exchanges."""
        removals = [
            WorkloadRemoval(workloadId=workload_id, originatedFrom=origin)
            for origin, workload_id in self._removed_at
        ]
        return list(self._latest.values()), removals

    def load(self, workloads: list[Workload], removals: list[WorkloadRemoval], now: float) -> int:
        """Merge a view (the broker's snapshot) into the dedup state, emitting nothing.

        The same rules as `receive`: a record counts if its `seq` is higher than the one
        held and no tombstone covers it. Returns how many records and removals were new.
        """
        new = 0
        for removal in removals:
            if self._remove(removal.pair, now) is None:
                new += 1
        counters = self.counters
        received, accepted = counters.received_local, counters.accepted
        for workload in workloads:
            if self.receive(workload, now, None)[0].__class__ is not Drop:
                new += 1
        # Loading is not receiving: keep the counters about traffic.
        counters.received_local, counters.accepted = received, accepted
        return new

    # -- maintenance ----------------------------------------------------------------------

    def prune(self, now: float) -> int:
        """Forget finished records and tombstones older than the retention; returns how many."""
        cutoff = now - self.retention_s
        pruned = 0
        while self._finished_at:
            key, at = self._finished_at.popitem(last=False)
            if at > cutoff:
                self._finished_at[key] = at
                self._finished_at.move_to_end(key, last=False)
                break
            self._forget(key)
            pruned += 1
        while self._removed_at:
            pair, at = self._removed_at.popitem(last=False)
            if at > cutoff:
                self._removed_at[pair] = at
                self._removed_at.move_to_end(pair, last=False)
                break
            pruned += 1
        self.counters.pruned += pruned
        return pruned

    # -- the rules --------------------------------------------------------------------------

    def _remove(self, pair: _Pair, now: float) -> tuple[Drop] | None:
        if pair in self._removed_at:
            self.counters.duplicate_removals += 1
            return _DROPPED_DUPLICATE
        origin, workload_id = pair
        runs = self._runs.get(origin, {})
        if len(runs) <= self.probe_max:
            candidates: tuple[str, ...] = tuple(runs)  # a few: a facade's starts
        else:
            index = self._by_id.get(origin)
            if index is None:
                index = self._by_id[origin] = self._index_of(origin)
            candidates = index.get(workload_id, ())
        latest = self._latest
        for run_id in candidates:
            key = (run_id, workload_id)
            held = latest.get(key)
            if held is not None and held.originatedFrom == origin:
                self._forget(key)
                self._finished_at.pop(key, None)
        self._removed_at[pair] = now
        self.counters.removals += 1
        if len(self._removed_at) > self.max_workloads:
            self._removed_at.popitem(last=False)
            self.counters.evicted += 1
        return None

    def _forget(self, key: _Key) -> None:
        self._uncount(self._latest.pop(key))

    def _uncount(self, workload: Workload) -> None:
        origin = workload.originatedFrom
        runs = self._runs[origin]
        left = runs[workload.runId] - 1
        if left:
            runs[workload.runId] = left
        elif len(runs) > 1:
            del runs[workload.runId]
        else:
            del self._runs[origin]
            self._by_id.pop(origin, None)
            return
        if self._by_id:
            index = self._by_id.get(origin)
            if index is not None:
                kept = tuple(run for run in index[workload.id] if run != workload.runId)
                if kept:
                    index[workload.id] = kept
                else:
                    del index[workload.id]

    def _index(self, workload: Workload) -> None:
        # A record counted under an origin that has its index by id: in the index too.
        index = self._by_id.get(workload.originatedFrom)
        if index is not None:
            index[workload.id] = (*index.get(workload.id, ()), workload.runId)

    def _index_of(self, origin: str) -> dict[str, tuple[str, ...]]:
        # One pass over every record held: a removal under an origin of many runs, once.
        index: dict[str, tuple[str, ...]] = {}
        for held in self._latest.values():
            if held.originatedFrom == origin:
                index[held.id] = (*index.get(held.id, ()), held.runId)
        return index

    def _evict_one(self) -> None:
        # Over the cap: the oldest finished record goes first, else the oldest record.
        if self._finished_at:
            key, _ = self._finished_at.popitem(last=False)
        else:
            key = self._arrivals.popleft()
            while key not in self._latest:  # forgotten since it arrived
                key = self._arrivals.popleft()
        self._forget(key)
        self.counters.evicted += 1
