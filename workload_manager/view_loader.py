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

__all__ = ["LOADER_PART", "load_view"]

log = logging.getLogger(__name__)

LOADER_PART: Final = "snapshot-loader"
SNAPSHOT_WAIT_S: Final = 5.0  # a page not answered by then is asked for again
SNAPSHOT_RETRIES: Final = 8  # then the view counts as incomplete (manager:status says so)
SNAPSHOT_BACKOFF_S: Final = (0.5, 8.0)  # first delay before asking again, and its cap


async def load_view(
    manager: Manager,
    send: Callable[[bytes], object],
    *,
    wait_s: float = SNAPSHOT_WAIT_S,
    retries: int = SNAPSHOT_RETRIES,
    backoff_s: tuple[float, float] = SNAPSHOT_BACKOFF_S,
) -> None:
    """Keep asking for the broker's view until every page is in: a page that failed, or
    was not answered within `wait_s`, is asked for again after an exponential backoff; after
    `retries` failures in a row the view counts as incomplete (logged, and shown in
    `manager:status`) rather than silently empty."""
    answered = asyncio.Event()
    outcome = [True]

    def on_answer(ok: bool) -> None:
        outcome[0] = ok
        answered.set()

    manager.on_snapshot_answer = on_answer
    failures = 0
    while manager.view_state == "loading":
        try:
            await asyncio.wait_for(answered.wait(), wait_s)
            answered.clear()
            ok = outcome[0]
        except TimeoutError:
            log.warning("no answer to workloads:snapshot within %gs", wait_s)
            ok = False
        if ok:
            failures = 0
            continue
        failures += 1
        if failures > retries:
            manager.snapshot_abandoned()
            return
        await asyncio.sleep(min(backoff_s[1], backoff_s[0] * 2 ** (failures - 1)))
        frame = manager.retry_snapshot()
        if frame is not None:
            send(frame)
