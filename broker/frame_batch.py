"""Frames for the workload manager child, written together every `FLUSH_S` at most.

Every request's lifecycle events in that time cost one system call and one wake-up of the
child, not one each (under load a write per request was a tenth of the agent's time). Order
is kept; a frame waits `FLUSH_S` at most, and the relay to peers lingers longer anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from broker.liveness import Drops

__all__ = ["FrameBatch"]

_GONE = "the workload manager is not running"
FLUSH_S: Final = 0.002


class FrameBatch:
    """Newline-delimited frames waiting for their one write to the child's stdin."""

    def __init__(
        self,
        current: Callable[[], asyncio.subprocess.Process | None],
        drops: Drops,
        max_unread: int,
    ) -> None:
        """`current()`: the child now; `drops` counts frames not handed to it; more than
        `max_unread` bytes waiting in its pipe means it is not reading."""
        self._current = current
        self._drops = drops
        self._max_unread = max_unread
        self._parts: list[bytes] = []
        self.size = 0  # bytes waiting for the write

    def send(self, proc: asyncio.subprocess.Process | None, frame: bytes) -> bool:
        """Queue `frame` for `proc` (written within `FLUSH_S`); False when dropped."""
        if proc is None or proc.returncode is not None or proc.stdin is None:
            # The child is restarting; it catches up through its snapshot and peers.
            return self._drops.dropped(_GONE)
        if proc.stdin.transport.get_write_buffer_size() + self.size > self._max_unread:
            # A child that does not read is stuck; the liveness check restarts it, and what
            # it missed it gets back from the Jobs store (its snapshot) and its catch-up.
            why = f"{self._max_unread // 2**20} MiB wait unread"
            return self._drops.dropped(why, unread=True)
        self._drops.delivered()
        if not self._parts:
            asyncio.get_running_loop().call_later(FLUSH_S, self._write, proc)
        self._parts.append(frame)
        self._parts.append(b"\n")
        self.size += len(frame) + 1
        return True

    def _write(self, proc: asyncio.subprocess.Process) -> None:
        parts, self._parts, self.size = self._parts, [], 0
        if proc is self._current() and proc.returncode is None and proc.stdin is not None:
            proc.stdin.write(b"".join(parts))
            return
        for _ in range(len(parts) // 2):  # it exited meanwhile
            self._drops.dropped(_GONE)
