"""Whether the workload manager child still answers: the supervisor's liveness check.

A child that is alive but stuck (stopped, deadlocked, busy forever) never exits, so the
restart policy never sees it; meanwhile the supervisor drops what it cannot hand over. The
watch asks `manager:status` every `interval_s` with a deadline; a child that does not answer
in time, or that could not take its input since the last look (frames dropped), is declared
hung, so the supervisor kills it and the restart that follows reloads the Jobs store's view
and catches its peers up -- which carries what was dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from broker.errors import ManagerRefused, ManagerUnavailable

__all__ = ["Drops", "Liveness", "watch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Liveness:
    """How often to ask the child, and how long it has to answer."""

    interval_s: float = 2.0
    deadline_s: float = 5.0


@dataclass(slots=True)
class Drops:
    """Frames the supervisor could not hand to the child, counted and logged per burst."""

    total: int = 0
    unread: int = 0  # by the running child's full input (reset at each start)
    _burst: bool = False

    def dropped(self, why: str, *, unread: bool = False) -> bool:
        """Count one dropped frame (`False`, for `_send` to return); the first of a burst
        is logged, the rest are only counted."""
        self.total += 1
        self.unread += unread
        if not self._burst:
            self._burst = True
            log.warning("dropping frames for the workload manager: %s", why)
        return False

    def delivered(self) -> None:
        """A frame went through: a burst of drops, if any, has ended."""
        if self._burst:
            self._burst = False
            log.info("the workload manager takes frames again (%d dropped in all)", self.total)


async def watch(
    ask: Callable[[], Awaitable[object]],
    unread_drops: Callable[[], int],
    liveness: Liveness,
    on_hung: Callable[[str], object],
) -> None:
    """Ask until the child fails to answer; then call `on_hung(why)` once and return.

    `ask()` is `manager:status` with `liveness.deadline_s`; `unread_drops()` counts the
    frames this child did not read. Cancelled by the supervisor when the child exits.
    """
    seen = unread_drops()
    while True:
        await asyncio.sleep(liveness.interval_s)
        try:
            await ask()
        except ManagerRefused:
            pass  # an error answer is still an answer
        except ManagerUnavailable as exc:
            on_hung(str(exc))
            return
        dropped = unread_drops()
        if dropped > seen:
            on_hung(f"it did not read {dropped - seen} frames (its input was full)")
            return
