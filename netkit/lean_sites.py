"""A `netkit.lean_http` listener behind `netkit.sites`' book: the same connection caps,
per-source caps and idle eviction as every nvpair listener, with the lean server's own
idle and body deadlines from the same `Bounds`."""

from __future__ import annotations

import asyncio
import dataclasses

from netkit.lean_http import LeanApp, LeanConnection
from netkit.sites import SHUTDOWN_S, Bounds, _Book, _Bounded, quiet_accept_errors

__all__ = ["LeanServer", "start_lean"]


class LeanServer:
    """A `netkit.lean_http` listener behind the book's caps; `aclose()` stops it."""

    def __init__(self, server: asyncio.Server, book: _Book) -> None:
        self._server = server
        self._book = book

    @property
    def port(self) -> int:
        """The port bound (the kernel's choice for port 0)."""
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def aclose(self, grace_s: float = SHUTDOWN_S) -> None:
        """Stop listening, close idle connections, give the requests in flight `grace_s`
        to end, then cancel them (their handlers see CancelledError)."""
        self._server.close()
        busy = []
        for conn in list(self._book.all):
            handler = conn.handler
            task = handler.serving if isinstance(handler, LeanConnection) else None
            if task is None:
                conn.evict()
            else:
                busy.append(task)
        if busy:
            _, late = await asyncio.wait(busy, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for conn in list(self._book.all):
            conn.evict()
        await self._server.wait_closed()


async def start_lean(app: LeanApp, host: str | None, port: int) -> LeanServer:
    """Serve `app` (`netkit.lean_http`) on `host:port` within `Bounds.from_env()`: the idle
    and body deadlines its own, the connection caps this module's book. `OSError` (errno
    EADDRINUSE) when the port is in use."""
    bounds = Bounds.from_env()
    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)
    app = dataclasses.replace(app, idle_s=bounds.idle_s, body_s=bounds.body_s)
    book = _Book(bounds)
    server = await loop.create_server(
        lambda: _Bounded(LeanConnection(app), book, None, bounds.handshake_s),
        host,
        port,
        reuse_address=True,
    )
    return LeanServer(server, book)
