"""One peer's outbox, sans-I/O: coalesce, batch, acknowledge, back off.

The outbox holds at most one pending event per workload: a newer `seq` replaces an older
one (coalescing), and a removal replaces every pending record of the workload it removes.
So its memory is bounded by live workloads, not by events, and a cap bounds even that.
Batches go out one at a time, oldest first: per workload, a peer sees `seq` only rise.

Time is passed in. `next_batch(now)` says what to send, if anything, given the backoff;
the runner reports the outcome with `ack()` or `fail()`. A failed batch waits a
`netkit.backoff.Backoff` delay, drawn from an injected random source so tests are
deterministic.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from netkit.backoff import Backoff
from workload_manager.errors import UsageError
from workload_manager.relay import Event
from workload_manager.workload import Workload, WorkloadRemoval

__all__ = ["Outbox", "OutboxCounters"]

DEFAULT_MAX_BATCH: Final = 1024
DEFAULT_MAX_PENDING: Final = 100_000

_Key = tuple[str, str, str]  # ("w", runId, id) or ("r", originatedFrom, id)


@dataclass(slots=True)
class OutboxCounters:
    """What `manager:status` shows per peer."""

    sent: int = 0  # events acknowledged by the peer
    batches: int = 0
    retried: int = 0  # batches that failed and will be sent again
    coalesced: int = 0  # events replaced by a newer one before they were sent
    dropped: int = 0  # events given up: over the cap, or refused by the peer as malformed
    last_error: str | None = None


class Outbox:
    """Pending events for one peer, coalesced per workload."""

    def __init__(
        self,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_pending: int = DEFAULT_MAX_PENDING,
        backoff: Backoff | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.max_batch = max_batch
        self.max_pending = max_pending
        self.backoff = backoff or Backoff()
        self.draw = draw
        self.counters = OutboxCounters()
        # Insertion order = send order. An OrderedDict, since batches are taken from the
        # front: a plain dict would rescan every slot deleted there before.
        self._pending: OrderedDict[_Key, Event] = OrderedDict()
        # At least how many removals wait (reset when nothing does): while none may, a record
        # is queued without looking for one that makes it moot.
        self._removals = 0
        self._in_flight: list[Event] | None = None
        self._failures = 0
        self._retry_at = 0.0

    @property
    def depth(self) -> int:
        """Events waiting, the batch in flight included."""
        return len(self._pending) + (len(self._in_flight) if self._in_flight else 0)

    @property
    def failures(self) -> int:
        """Consecutive failed batches (0 while the peer is healthy)."""
        return self._failures

    def add(self, event: Event) -> int:
        """Queue an event, replacing what it supersedes; returns how many wait (the batch in
        flight not counted), so its sender can tell whether a batch is full."""
        if type(event) is Workload:
            key: _Key = ("w", event.runId, event.id)
            if self._removals and ("r", event.originatedFrom, event.id) in self._pending:
                self.counters.coalesced += 1  # a removal is pending: the record is moot
                return len(self._pending)
            old = self._pending.get(key)
            if old is not None:
                assert type(old) is Workload
                self.counters.coalesced += 1
                if old.seq >= event.seq:
                    return len(self._pending)
                self._pending[key] = event  # replaced in place: it keeps its turn
                return len(self._pending)
        else:
            assert type(event) is WorkloadRemoval
            key = ("r", event.originatedFrom, event.workloadId)
            # Removals are rare: finding the records they supersede by a scan keeps the
            # common path (add a record) free of an index.
            moot = [
                k
                for k, pending in self._pending.items()
                if type(pending) is Workload
                and pending.id == event.workloadId
                and pending.originatedFrom == event.originatedFrom
            ]
            for k in moot:
                del self._pending[k]
            self.counters.coalesced += len(moot)
            if self._pending.pop(key, None) is not None:
                self.counters.coalesced += 1
            self._removals += 1
        self._pending[key] = event
        if len(self._pending) > self.max_pending:
            self._drop_oldest()
        return len(self._pending)

    def next_batch(self, now: float) -> list[Event] | None:
        """The next batch to send, or None (nothing pending, one in flight, backing off)."""
        if self._in_flight is not None or not self._pending or now < self._retry_at:
            return None
        pending = self._pending
        if len(pending) <= self.max_batch:  # everything waiting fits: taken at once
            batch = list(pending.values())
            pending.clear()
            self._removals = 0
        else:
            batch = [pending.popitem(last=False)[1] for _ in range(self.max_batch)]
        self._in_flight = batch
        return batch

    def retry_at(self) -> float:
        """When the next batch may go (0 when it may go now)."""
        return self._retry_at

    def ack(self) -> None:
        """The peer took the batch in flight."""
        batch = self._take_in_flight()
        self.counters.sent += len(batch)
        self.counters.batches += 1
        self._failures = 0
        self._retry_at = 0.0
        self.counters.last_error = None

    def fail(self, now: float, error: str, *, retry: bool = True) -> float:
        """The batch in flight failed; returns when to try again.

        With `retry`, its events go back to the front of the outbox unless something newer
        for the same workload arrived meanwhile; without it (the peer called the batch
        malformed: sending it again cannot help) they are dropped and counted.
        """
        batch = self._take_in_flight()
        self.note_failure(now, error)
        if not retry:
            self.counters.dropped += len(batch)
            return self._retry_at
        self.counters.retried += 1
        newer = self._pending
        self._pending = OrderedDict()
        for event in batch:
            self.add(event)
        for event in newer.values():
            self.add(event)
        return self._retry_at

    def note_failure(self, now: float, error: str) -> float:
        """A send with no batch in it (a catch-up request alone) failed: back off too."""
        self.counters.last_error = error
        self._failures += 1
        self._retry_at = now + self.backoff.delay(self._failures, self.draw)
        return self._retry_at

    def resume(self) -> bool:
        """The peer showed it is up: end the backoff, so the next batch may go now.

        Returns whether there was a backoff to end. The failure count restarts too: the
        peer's next failure is a first one again.
        """
        if self._failures == 0 and self._retry_at == 0.0:
            return False
        self._failures = 0
        self._retry_at = 0.0
        return True

    def clear(self) -> None:
        """Forget everything (the peer left the cluster)."""
        self.counters.dropped += self.depth
        self._pending.clear()
        self._removals = 0
        self._in_flight = None

    def _take_in_flight(self) -> list[Event]:
        if self._in_flight is None:
            raise UsageError("no batch in flight")
        batch, self._in_flight = self._in_flight, None
        return batch

    def _drop_oldest(self) -> None:
        self._pending.popitem(last=False)
        self.counters.dropped += 1
