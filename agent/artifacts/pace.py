"""A bound on the bytes a second artifact transfers take (`[artifacts] max_rate`, issue 28),
so that fetching a 100 GB model does not starve the inference traffic on the same link.

`Pace.take(n)` waits until `n` more bytes fit: each transfer reserves its slot on one
timeline (`_next`), so any number of pieces in flight together move at most `rate` bytes a
second on average, after a burst of at most one second's worth. Fetching and serving each
have their own pace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final

__all__ = ["Pace"]

BURST_S: Final = 1.0  # an idle pace lets this many seconds' worth through at once


class Pace:
    """At most `rate` bytes a second (0: no bound)."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._next = 0.0  # when the timeline is free again

    def delay(self, size: int) -> float:
        """Reserve `size` bytes; how long to wait before sending them (a generic cell rate
        check: the timeline may run at most `BURST_S` ahead of now)."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        free_at = max(self._next, now)
        self._next = free_at + size / self.rate
        return max(0.0, free_at - BURST_S - now)

    def refund(self, size: int) -> None:
        """`size` bytes reserved were not sent after all (the source was busy)."""
        if self.rate > 0:
            self._next = max(self._clock() - BURST_S, self._next - size / self.rate)

    def backlog(self) -> float:
        """Seconds of bytes already reserved beyond now (0: idle, or no bound)."""
        return max(0.0, self._next - self._clock()) if self.rate > 0 else 0.0

    async def take(self, size: int) -> None:
        """Wait until `size` more bytes fit in the rate."""
        wait = self.delay(size)
        if wait > 0:
            await asyncio.sleep(wait)  # pacing, not synchronisation: the rate is the point
