"""Lifecycle events held a moment before they reach the workload manager, the latest per job.

A request the facade takes is three events -- `workload:submitted`, `workload:started`,
`workload:completed` (or `workload:errored`) -- and most requests end within milliseconds.
Each event the manager gets is decoded, de-duplicated, encoded and relayed to every peer,
whose Jobs stores write it; for a job that is already over by then, the first two are work
no member needs. So the events of one job are held for `HOLD_S` from its first: a later
record of the same job (a higher `seq`) replaces the held one, and when its hold ends it goes
to the manager, jobs in the order they came. (One hold for all jobs, from the first event
after a quiet moment, would cut the jobs that started near its end in two: a third of them
at 2,000 requests/s.)

What the contract (seed 002) asks still holds, as docs/jobs.md says:

- every state a job passes through is recorded: the record that goes out carries
  `createdAt`, `startedAt`, `completedAt` and `scheduledOn`; a job that lives longer than
  `HOLD_S` is announced in each state it is in when its hold ends, as before;
- per job, records go out in `seq` order (a held one is only ever replaced by a newer one);
- this member's own Jobs store and page get every event at once (`JobsWriter`, the feed);
- nothing is held past `HOLD_S`, and any other frame (a removal, a request, the peers)
  sends what is held first, so a removal never overtakes the job it removes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from workload_manager.workload import Workload

__all__ = ["HOLD_S", "MAX_HELD", "EventHold"]

HOLD_S: Final = 0.02  # about the relay's own linger (workload_manager.broadcaster.LINGER_S)
MAX_HELD: Final = 4096  # jobs held at most; one more sends them all at once


class EventHold:
    """Events waiting for their hold to end, keyed by job; `send(method, record)` gets them.

    Each job's hold runs from its own first event, so a short job is not cut in two by a hold
    that began with another job. One timer runs, for the oldest job held; when it fires, every
    job whose hold ends within a quarter of `hold_s` goes too (a hold is `hold_s` less at most
    that), so the timer fires about four times per hold under load, not once per job.
    """

    def __init__(
        self,
        send: Callable[[str, Workload], object],
        *,
        hold_s: float = HOLD_S,
        max_held: int = MAX_HELD,
    ) -> None:
        self._send = send
        self._hold_s = hold_s
        self._slack_s = hold_s / 4
        self._max_held = max_held
        # In the order the jobs came (a replaced value keeps its place): key -> (method,
        # record, when its hold ends).
        self._held: dict[tuple[str, str, str], tuple[str, Workload, float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.replaced = 0  # events never sent: a newer record of their job went instead

    def __len__(self) -> int:
        return len(self._held)

    def put(self, method: str, record: Workload) -> None:
        """Hold `record` (announced by `method`) until its job's hold ends, unless a newer
        record of its job comes first."""
        key = (record.originatedFrom, record.runId, record.id)
        held = self._held.get(key)
        if held is not None:
            if held[1].seq >= record.seq:
                return  # an older record after a newer one: the newer stands
            self.replaced += 1
            self._held[key] = (method, record, held[2])
            return
        loop = asyncio.get_running_loop()
        ends = loop.time() + self._hold_s
        self._held[key] = (method, record, ends)
        if len(self._held) >= self._max_held:
            self.flush()
        elif self._timer is None:
            self._timer = loop.call_at(ends, self._due)

    def flush(self) -> None:
        """Send everything held, now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, {}
        for method, record, _ in held.values():
            self._send(method, record)

    def _due(self) -> None:
        # The oldest job's hold has ended: send it and every job whose hold ends soon, in
        # the order they came, and wait for the next.
        self._timer = None
        loop = asyncio.get_running_loop()
        until = loop.time() + self._slack_s
        held = self._held
        send = self._send
        while held:
            key = next(iter(held))
            method, record, ends = held[key]
            if ends > until:
                self._timer = loop.call_at(ends, self._due)
                return
            del held[key]
            send(method, record)
