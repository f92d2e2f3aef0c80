"""Small loops over the Jobs store (the pending work per node, and retention), and the
GPU re-read.

`LoadPoller` reads, every `LOAD_REFRESH_S`, how many queued and running jobs other members
placed on each node (from the shared Jobs view); the facade adds its own in-flight count.
`Pruner` deletes finished jobs past the retention and old removal tombstones;
`gpu_reader` re-reads this node's GPUs for its heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from agent.engines.gpus import discover
from broker.errors import BrokerError

__all__ = ["LoadPoller", "Pruner", "gpu_reader"]

log = logging.getLogger(__name__)

LOAD_REFRESH_S: Final = 0.5
PRUNE_EVERY_S: Final = 300.0
TOMBSTONE_KEEP_S: Final = 86_400.0


class LoadPoller:
    """`remote` is the latest count of others' pending jobs per node."""

    def __init__(
        self,
        read: Callable[[], Awaitable[dict[str, int]]],
        on_refresh: Callable[[], None] = lambda: None,
    ) -> None:
        self._read = read
        self._on_refresh = on_refresh  # others' jobs may have ended: the facade's waiters look
        self.remote: dict[str, int] = {}

    async def run(self) -> None:
        """Refresh `remote` every `LOAD_REFRESH_S`, forever."""
        while True:
            try:
                self.remote = await self._read()
                self._on_refresh()
            except (BrokerError, sqlite3.Error) as exc:
                # The store's own health says why; the last counts stay the best guess.
                log.debug("pending work not refreshed: %s", exc)
            await asyncio.sleep(LOAD_REFRESH_S)


class Pruner:
    """Deletes what is past the retention, every `PRUNE_EVERY_S`."""

    def __init__(
        self,
        prune: Callable[[int, float], Awaitable[int]],
        *,
        retention_h: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._prune = prune
        self._retention_ms = int(retention_h * 3600 * 1000)
        self._clock = clock

    async def once(self) -> int:
        """Prune now; returns how many jobs went."""
        now = self._clock()
        pruned = await self._prune(int(now * 1000) - self._retention_ms, now - TOMBSTONE_KEEP_S)
        if pruned:
            log.info("pruned %d finished jobs past the retention", pruned)
        return pruned

    async def run(self) -> None:
        """Prune every `PRUNE_EVERY_S`, forever."""
        while True:
            await asyncio.sleep(PRUNE_EVERY_S)
            try:
                await self.once()
            except (BrokerError, sqlite3.Error) as exc:
                log.warning("pruning the Jobs store failed, trying again later: %s", exc)


def gpu_reader(node_id: str) -> Callable[[], Awaitable[Any]]:
    """The heartbeat's GPU re-read: memory in use and utilisation move, and NVML calls
    block, so each read runs off the loop."""

    async def read() -> Any:
        return await asyncio.to_thread(discover, node_id)

    return read
