"""Loading the broker's view into a (re)started manager, page by page, until it is whole.

The manager asks for `workloads:snapshot` right after `ready`; a page answered with an
error, malformed, refused by the framer (over the frame limit) or not answered at all is
asked for again after a backoff, a bounded number of times. What each answer means is the
`Manager`'s business; this only times and bounds the retries (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from workload_manager.manager import Manager

__all__ = ["LOADER_PART", "ViewLoader"]

log = logging.getLogger(__name__)

LOADER_PART: Final = "snapshot-loader"
SNAPSHOT_WAIT_S: Final = 5.0  # a page not answered by then is asked for again
SNAPSHOT_RETRIES: Final = 8  # then the view counts as incomplete (manager:status says so)
SNAPSHOT_BACKOFF_S: Final = (0.5, 8.0)  # first delay before asking again, and its cap


class ViewLoader:
    """Asks again for the pages of the broker's view that fail or go unanswered.

    The `Manager` is given `on_answer` when it is built and calls it with each answer to its
    snapshot request; each broker connection runs `load()` once, after its first request.
    """

    def __init__(
        self,
        *,
        wait_s: float = SNAPSHOT_WAIT_S,
        retries: int = SNAPSHOT_RETRIES,
        backoff_s: tuple[float, float] = SNAPSHOT_BACKOFF_S,
    ) -> None:
        self.wait_s = wait_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._answered = asyncio.Event()
        self._ok = True

    def on_answer(self, ok: bool) -> None:
        """An answer to the snapshot request came: True a page, False a failure."""
        self._ok = ok
        self._answered.set()

    async def load(self, manager: Manager, send: Callable[[bytes], object]) -> None:
        """Keep asking for the broker's view until every page is in: a page that failed, or
        was not answered within `wait_s`, is asked for again after an exponential backoff;
        after `retries` failures in a row the view counts as incomplete (logged, and shown
        in `manager:status`) rather than silently empty."""
        self._answered.clear()  # this connection's answers only
        failures = 0
        while manager.view_state == "loading":
            try:
                await asyncio.wait_for(self._answered.wait(), self.wait_s)
                self._answered.clear()
                ok = self._ok
            except TimeoutError:
                log.warning("no answer to workloads:snapshot within %gs", self.wait_s)
                ok = False
            if ok:
                failures = 0
                continue
            failures += 1
            if failures > self.retries:
                manager.snapshot_abandoned()
                return
            first, cap = self.backoff_s
            await asyncio.sleep(min(cap, first * 2 ** (failures - 1)))
            frame = manager.retry_snapshot()
            if frame is not None:
                send(frame)
