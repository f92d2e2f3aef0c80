"""Starting an aiohttp site, bounded, and learning the port it bound.

Every nvpair server (the inter-node server, the agent's APIs and facade, the plane, the mock
engine) binds the same way, so every listener has the same bounds (issue 12, item 5):

- a request's headers must arrive, and a kept-alive connection may stay idle, at most
  `idle_s` (aiohttp's `keepalive_timeout`, which since 3.14 also runs from the connection's
  start: a partial request line held forever is closed when it passes);
- a request's body must have arrived `body_s` after its handler started (a middleware
  watches the payload's end; past it the connection is closed);
- a TLS handshake must finish within `handshake_s` (`ssl_handshake_timeout`: a partial
  ClientHello is dropped when it passes);
- at most `max_connections` connections on the listener and `max_per_source` from one
  address. A connection over a cap first evicts the oldest idle connection (one that has not
  sent a whole request: a half-open one, or a kept-alive one between requests, which aiohttp's
  own keep-alive would close the same way); only when every one is busy is it refused.

The bounds come from the environment (tests set small ones): NVPAIR_IDLE_TIMEOUT_S,
NVPAIR_BODY_TIMEOUT_S, NVPAIR_TLS_HANDSHAKE_TIMEOUT_S, NVPAIR_MAX_CONNECTIONS,
NVPAIR_MAX_CONNECTIONS_PER_SOURCE.
Port 0 asks the kernel for a free port, which tests use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

__all__ = ["Bounds", "PerSourceRate", "handler_bounds", "start_site"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bounds:
    """What one listener allows (see the module docstring)."""

    idle_s: float = 30.0
    body_s: float = 60.0
    handshake_s: float = 10.0
    max_connections: int = 1024
    max_per_source: int = 128

    @classmethod
    def from_env(cls) -> Bounds:
        """The defaults, with the NVPAIR_* overrides the environment sets."""
        env = os.environ
        return cls(
            idle_s=float(env.get("NVPAIR_IDLE_TIMEOUT_S", cls.idle_s)),
            body_s=float(env.get("NVPAIR_BODY_TIMEOUT_S", cls.body_s)),
            handshake_s=float(env.get("NVPAIR_TLS_HANDSHAKE_TIMEOUT_S", cls.handshake_s)),
            max_connections=int(env.get("NVPAIR_MAX_CONNECTIONS", cls.max_connections)),
            max_per_source=int(env.get("NVPAIR_MAX_CONNECTIONS_PER_SOURCE", cls.max_per_source)),
        )


def handler_bounds() -> dict[str, Any]:
    """The `web.AppRunner` keyword arguments that bound headers and idle keep-alive."""
    return {"keepalive_timeout": Bounds.from_env().idle_s}


async def start_site(
    runner: web.AppRunner,
    host: str | None,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> int:
    """Set `runner` up, serve it on `host:port` within `Bounds.from_env()` and return the
    port actually bound.

    `host` None listens on every interface. An address in use raises `OSError` (errno
    EADDRINUSE) from the bind, with the runner left set up for the caller's `cleanup()`.
    """
    bounds = Bounds.from_env()
    runner.app.middlewares.append(_body_deadline(bounds.body_s))  # frozen by setup()
    await runner.setup()
    site = _BoundedSite(runner, host, port, ssl_context=ssl_context, bounds=bounds)
    await site.start()
    return site.port  # the bound port once started (the kernel's choice for port 0)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _body_deadline(body_s: float) -> Middleware:
    """A middleware closing the connection of a request whose body is still arriving
    `body_s` after its handler started (a slow body would hold a handler for ever)."""

    @web.middleware
    async def body_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists or request.content.is_eof():
            return await handler(request)

        def expire() -> None:
            if not request.content.is_eof() and request.transport is not None:
                log.info("closing a connection whose body took over %g s", body_s)
                request.transport.close()

        timer = asyncio.get_running_loop().call_later(body_s, expire)
        try:
            return await handler(request)
        finally:
            timer.cancel()

    return body_deadline


class _BoundedSite(web.TCPSite):
    """A TCPSite whose connections pass through a `_Book` and whose handshakes time out."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str | None,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        bounds: Bounds,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._bounds = bounds
        self._where = (host, port)
        self._listening: asyncio.Server | None = None

    async def start(self) -> None:
        # BaseSite.start registers the site with its runner (its cleanup closes it).
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None  # set up by start_site
        book = _Book(self._bounds)
        ssl_context = self._ssl_context
        self._server = self._listening = await asyncio.get_running_loop().create_server(
            lambda: _Bounded(server(), book),
            self._where[0],
            self._where[1],
            ssl=ssl_context,
            ssl_handshake_timeout=self._bounds.handshake_s if ssl_context else None,
            reuse_address=True,
        )

    @property
    def port(self) -> int:
        assert self._listening is not None  # started
        port: int = self._listening.sockets[0].getsockname()[1]
        return port


def _idle(handler: RequestHandler) -> bool:
    # Waiting for a request's headers (the first or the next on a kept-alive connection):
    # the state aiohttp's own keep-alive closes on. `_waiter` is its private future.
    waiter = getattr(handler, "_waiter", None)
    return waiter is not None and not waiter.done()


class _Book:
    """The open connections of one listener, per source address, oldest first."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.all: OrderedDict[_Bounded, None] = OrderedDict()
        self.by_source: dict[str, OrderedDict[_Bounded, None]] = {}
        self.refused = 0
        self._refusals = PerSourceRate(per_s=0.1, burst=1)  # one log line per 10 s

    def admit(self, conn: _Bounded) -> bool:
        """Make room for `conn` (evicting an idle connection over a cap); False: refused."""
        mine = self.by_source.setdefault(conn.source, OrderedDict())
        for pool, cap in (
            (mine, self.bounds.max_per_source),
            (self.all, self.bounds.max_connections),
        ):
            if len(pool) >= cap and not _evict(pool):
                self.refused += 1
                if self._refusals.allow("log"):
                    log.warning(
                        "refusing connections from %s: every connection is busy (%d refused)",
                        conn.source,
                        self.refused,
                    )
                if not mine:
                    del self.by_source[conn.source]
                return False
        mine[conn] = None
        self.all[conn] = None
        return True

    def forget(self, conn: _Bounded) -> None:
        self.all.pop(conn, None)
        mine = self.by_source.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_source[conn.source]


def _evict(pool: OrderedDict[_Bounded, None]) -> bool:
    for conn in pool:
        if _idle(conn.handler):
            conn.evict()
            return True
    return False


class _Bounded(asyncio.Protocol):
    """aiohttp's handler behind the listener's caps: connects only once admitted."""

    def __init__(self, handler: RequestHandler, book: _Book) -> None:
        self.handler = handler
        self.book = book
        self.source = ""
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream server's
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self.admitted = self.book.admit(self)
        if not self.admitted:
            transport.abort()
            return
        self.handler.connection_made(transport)

    def evict(self) -> None:
        self.book.forget(self)
        self.handler.force_close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.book.forget(self)
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.handler.data_received(data)

    def eof_received(self) -> None:
        if self.admitted:
            self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class PerSourceRate:
    """A token bucket per key (a source address): `burst` at once, `per_s` refilled each
    second. Pure: time is `time.monotonic()` unless `now` is given."""

    MAX_KEYS: Final = 4096  # the oldest keys go first past this, so strangers cannot grow it

    def __init__(self, *, per_s: float, burst: int) -> None:
        self.per_s = per_s
        self.burst = burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str, now: float | None = None) -> bool:
        """Take one token for `key`; False when it has none left."""
        now = time.monotonic() if now is None else now
        tokens, then = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.per_s)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.MAX_KEYS:
            self._buckets.popitem(last=False)
        return allowed
