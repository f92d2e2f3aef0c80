"""Structured lifetimes for the agent's background work, and the health it reports.

`Health` is what `/healthz` reads: a part is failing when a task of it died (with the
traceback logged) or when its own probe says so (the Jobs store that cannot write, the
workload manager that is not running). `Tasks` owns every background task of the agent:
each is named after its part, a task that dies is logged and marks the part failing, and
`aclose()` cancels them all and waits, within a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final

from agent.core.errors import AgentError

__all__ = ["SHUTDOWN_S", "Health", "Tasks"]

log = logging.getLogger(__name__)

CLOSE_BOUND_S: Final = 5.0
# How long a server waits for its requests in flight when it stops (aiohttp's default is
# 60 s, longer than any operator waits for `systemctl stop`).
SHUTDOWN_S: Final = 2.0


class Health:
    """Which parts of the agent are failing, and why (no record content, only causes)."""

    def __init__(self) -> None:
        self._died: dict[str, str] = {}
        self._probes: dict[str, Callable[[], str | None]] = {}

    def watch(self, part: str, probe: Callable[[], str | None]) -> None:
        """Ask `probe()` on every health read: None is ok, a string is why it is failing."""
        self._probes[part] = probe

    def died(self, part: str, error: str) -> None:
        """A part's task ended with an error: failing until the agent restarts."""
        self._died[part] = error[:500]

    def failing(self) -> list[dict[str, str]]:
        """Every failing part with its reason, in a stable order."""
        found = dict(self._died)
        for part, probe in self._probes.items():
            reason = probe()
            if reason is not None and part not in found:
                found[part] = reason[:500]
        return [{"part": part, "error": error} for part, error in sorted(found.items())]


class Tasks:
    """The agent's task group: `spawn()` while running, `aclose()` ends them all."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def spawn(self, part: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as part `part`; if it raises, log the traceback and mark it failing."""
        if self._closing:
            coro.close()
            raise AgentError("the agent is stopping: nothing new may start")
        task = asyncio.create_task(coro, name=part)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s failed", task.get_name(), exc_info=exc)
            self._health.died(task.get_name(), f"{type(exc).__name__}: {exc}")

    async def aclose(self, bound_s: float = CLOSE_BOUND_S) -> None:
        """Cancel every task and wait for them, at most `bound_s`."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=bound_s)
            for task in pending:
                log.warning("%s did not stop within %.0fs", task.get_name(), bound_s)
