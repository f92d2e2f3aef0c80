"""What this member has in flight on each replica, now and a little while ago.

A replica's load report counts everything its engine holds, ours included, as of when it
was read (up to a scrape, and for another member's replica a heartbeat, ago). To count the
others' requests at a replica's `maxInFlight` (`scheduler.replicas.in_use`) we need ours at
that instant, not now: a request of ours that finished since the report is still in it, and
taking ours now would hold the freed slot until the next report. So each change is kept,
with its time, for `KEEP_MS` (the age past which a report is stale anyway), and `then(r,
age_ms)` answers with a bisection.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from typing import Final

__all__ = ["KEEP_MS", "InFlight"]

KEEP_MS: Final = 5_000.0  # scheduler.replicas.STALE_MS: an older report is not used
MAX_CHANGES: Final = 10_000  # per replica, however fast requests come and go


class InFlight(dict[str, int]):
    """Replica id -> our requests on it now (a plain mapping for ranking), plus `then`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        # replica -> (times in ms, counts after each change), oldest first
        self._history: dict[str, tuple[deque[float], deque[int]]] = {}

    def add(self, replica: str, delta: int) -> None:
        """One of our requests went to (+1) or left (-1) `replica`."""
        count = max(0, self.get(replica, 0) + delta)
        self[replica] = count
        now = self._clock() * 1000
        times, counts = self._history.setdefault(replica, (deque(), deque()))
        times.append(now)
        counts.append(count)
        # Keep one change at or before the oldest instant asked about: the count then.
        while len(times) > 1 and (times[1] < now - KEEP_MS or len(times) > MAX_CHANGES):
            times.popleft()
            counts.popleft()

    def then(self, replica: str, age_ms: float) -> int:
        """Our requests on `replica` `age_ms` ago (as far back as `KEEP_MS`)."""
        history = self._history.get(replica)
        if history is None:
            return self.get(replica, 0)
        times, counts = history
        at = self._clock() * 1000 - max(0.0, age_ms)
        i = bisect.bisect_right(times, at)  # changes at or before `at`
        return counts[i - 1] if i else 0
