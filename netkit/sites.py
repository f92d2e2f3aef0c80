"""Starting an aiohttp site, bounded, and learning the port it bound.

Every nvpair server (the inter-node server, the agent's APIs and facade, the plane, the mock
engine) binds the same way, `start_runner`, so every listener has the same bounds (issue 12,
item 5):

- a request's headers must arrive, and a kept-alive connection may stay idle, at most
  `idle_s` (aiohttp's `keepalive_timeout`, which since 3.14 also runs from the connection's
  start: a partial request line held forever is closed when it passes);
- a request's body must have arrived `body_s` after its handler started (a middleware
  watches the payload's end; past it the connection is closed);
- a TLS handshake must finish within `handshake_s` (a partial ClientHello is dropped when
  it passes); a connection is admitted under the caps below before its handshake starts,
  so handshakes in progress are capped like the rest;
- at most `max_connections` connections on the listener and `max_per_source` from one
  address. A connection over a cap first evicts the oldest idle connection (one that has not
  sent a whole request: a half-open one, one still in its handshake, one closing, or a
  kept-alive one between requests, which aiohttp's own keep-alive would close the same way);
  only when every one is busy is it refused. An evicted connection is aborted, not closed
  gracefully: a TLS close waits for the peer's close_notify, and a stranger that never reads
  would hold the descriptor for the whole shutdown timeout after the book had let it go --
  the way 1,100 completed handshakes from one address once exhausted the descriptors. A
  connection counts until its transport is gone, so the caps are the descriptors held.
- a connection whose client presented a certificate of the cluster's CA (a member) is never
  evicted by a newcomer, and does not count against its address's cap: strangers at a
  member's address cannot push the member out. aiohttp's keep-alive closes it when idle.
- on a TLS listener, before any TLS work: at most `handshakes` handshakes in progress and
  `handshakes_per_source` from one address (over either, the oldest handshake in progress is
  evicted -- a member's takes milliseconds, a stranger's partial ClientHello is the oldest);
  and an address no member has connected from gets `stranger_handshakes_per_s` new
  handshakes a second (a burst of four times that), all such addresses together four times
  that: a handshake costs milliseconds of CPU on the event loop that also serves the local
  API, so strangers, from however many addresses, get a bounded share of it.

The caps also fit the process's open-files limit: a listener holds at most a quarter of
what is left after `FD_RESERVE` descriptors (stores, logs, pipes, the connections this
process makes), so a stranger filling every listener still leaves descriptors for the
member connections, the local API and the Jobs store. Past the limit the kernel refuses
`accept()` itself -- before any eviction can run -- which would starve every listener at
once. `raise_open_files_limit()` (called at start) lifts the soft limit to the hard one,
so the caps are rarely the limit's on a host that allows more.

The bounds come from the environment (tests set small ones): NVPAIR_IDLE_TIMEOUT_S,
NVPAIR_BODY_TIMEOUT_S, NVPAIR_TLS_HANDSHAKE_TIMEOUT_S, NVPAIR_MAX_CONNECTIONS,
NVPAIR_MAX_CONNECTIONS_PER_SOURCE, NVPAIR_STRANGER_HANDSHAKES_PER_S.
Port 0 asks the kernel for a free port, which tests use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import resource
import ssl
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from netkit.lean_http import LeanApp, LeanConnection

__all__ = [
    "Bounds",
    "PerSourceRate",
    "handler_bounds",
    "quiet_accept_errors",
    "raise_open_files_limit",
    "start_runner",
    "start_site",
]

log = logging.getLogger(__name__)

FD_RESERVE: Final = 256  # descriptors kept back from the listeners
FD_LISTENERS: Final = 4  # the most listeners one process serves (the agent: three)
FD_CAP: Final = 1 << 20  # what raise_open_files_limit asks for at most
SHUTDOWN_S: Final = 2.0  # the most a TLS close waits for the peer's close_notify
STALE_S: Final = 1.0  # a TLS handshake in progress this long may be evicted for a newcomer


def raise_open_files_limit() -> int:
    """Lift the soft open-files limit to the hard one (at most `FD_CAP`); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_CAP if hard == resource.RLIM_INFINITY else min(hard, FD_CAP)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # a container may refuse; the caps still fit
            log.info("open-files limit stays %d: %s", soft, exc)
    return soft


def _fd_share() -> int:
    """The most connections one listener may hold under the open-files limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return FD_CAP
    return max(16, (soft - FD_RESERVE) // FD_LISTENERS)


@dataclass(frozen=True)
class Bounds:
    """What one listener allows (see the module docstring)."""

    idle_s: float = 30.0
    body_s: float = 60.0
    handshake_s: float = 10.0
    max_connections: int = 1024
    max_per_source: int = 128
    handshakes: int = 128
    handshakes_per_source: int = 32
    stranger_handshakes_per_s: float = 16.0

    @classmethod
    def from_env(cls) -> Bounds:
        """The defaults, with the NVPAIR_* overrides the environment sets, the connection
        caps cut to the open-files limit's share."""
        env = os.environ
        most = min(int(env.get("NVPAIR_MAX_CONNECTIONS", cls.max_connections)), _fd_share())
        per_source = int(env.get("NVPAIR_MAX_CONNECTIONS_PER_SOURCE", cls.max_per_source))
        return cls(
            idle_s=float(env.get("NVPAIR_IDLE_TIMEOUT_S", cls.idle_s)),
            body_s=float(env.get("NVPAIR_BODY_TIMEOUT_S", cls.body_s)),
            handshake_s=float(env.get("NVPAIR_TLS_HANDSHAKE_TIMEOUT_S", cls.handshake_s)),
            max_connections=most,
            max_per_source=min(per_source, most),
            stranger_handshakes_per_s=float(
                env.get("NVPAIR_STRANGER_HANDSHAKES_PER_S", cls.stranger_handshakes_per_s)
            ),
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
    lean: tuple[str, LeanApp] | None = None,
) -> int:
    """Set `runner` up, serve it on `host:port` within `Bounds.from_env()` and return the
    port actually bound.

    `host` None listens on every interface. An address in use raises `OSError` (errno
    EADDRINUSE) from the bind, with the runner left set up for the caller's `cleanup()`.
    `lean` (an ALPN name and an application): a TLS connection that agrees on that name is
    served by `netkit.lean_http` instead of aiohttp (`start_lean`'s bounds).
    """
    bounds = Bounds.from_env()
    quiet_accept_errors(asyncio.get_running_loop())
    runner.app.middlewares.append(_body_deadline(bounds.body_s))  # frozen by setup()
    await runner.setup()
    if lean is not None:
        lean = (lean[0], dataclasses.replace(lean[1], idle_s=bounds.idle_s, body_s=bounds.body_s))
    site = _BoundedSite(runner, host, port, ssl_context=ssl_context, bounds=bounds, lean=lean)
    await site.start()
    return site.port  # the bound port once started (the kernel's choice for port 0)


async def start_runner(
    app: web.Application,
    host: str | None,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    bound_idle: bool = True,
    lean: tuple[str, LeanApp] | None = None,
    **options: Any,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on `host:port` as `start_site` does, from a runner of its own; returns
    the runner (its `cleanup()` stops serving) and the port bound.

    The runner every nvpair server has: no access log, no signal handlers (the process owns
    them), idle keep-alive bounded (`handler_bounds()`; aiohttp's own with `bound_idle`
    False), and `options`, `web.AppRunner`'s other keywords, over those. A bind that fails
    cleans the runner up and raises (`OSError`, errno EADDRINUSE for a port in use).
    """
    defaults: dict[str, Any] = {"access_log": None, "handle_signals": False}
    if bound_idle:
        defaults |= handler_bounds()
    runner = web.AppRunner(app, **(defaults | options))
    try:
        return runner, await start_site(runner, host, port, ssl_context=ssl_context, lean=lean)
    except BaseException:
        await runner.cleanup()
        raise


_OUT_OF_RESOURCE: Final = "socket.accept() out of system resource"
_quieted: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's "out of system resource" on `accept()` (EMFILE and the like) at most
    once every 10 s, with how many were not logged; every other error as before.

    Out of descriptors, asyncio's accept loop reports the error once per connection waiting
    in the backlog, each with a traceback, and schedules as many retries: 90,000 lines in
    half a minute under a stranger's flood, before the caps fit the descriptors."""
    if loop in _quieted:
        return
    _quieted.add(loop)
    previous = loop.get_exception_handler()
    lines = PerSourceRate(per_s=0.1, burst=1)
    unlogged = 0

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal unlogged
        if context.get("message") == _OUT_OF_RESOURCE:
            if not lines.allow("accept"):
                unlogged += 1
                return
            context = {**context, "message": f"{_OUT_OF_RESOURCE} ({unlogged} more not logged)"}
            unlogged = 0
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    loop.set_exception_handler(handle)


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
        lean: tuple[str, LeanApp] | None = None,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._bounds = bounds
        self._lean = lean
        self._where = (host, port)
        self._listening: asyncio.Server | None = None

    async def start(self) -> None:
        # BaseSite.start registers the site with its runner (its cleanup closes it).
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None  # set up by start_site
        book = _Book(self._bounds)
        tls, handshake_s = self._ssl_context, self._bounds.handshake_s
        # No `ssl=` here: each connection is admitted by the book as soon as it is accepted
        # and only then starts its TLS handshake (`_Bounded`), so connections still in
        # their handshake count against the caps too.
        self._server = self._listening = await asyncio.get_running_loop().create_server(
            lambda: _Bounded(server(), book, tls, handshake_s, self._lean),
            self._where[0],
            self._where[1],
            reuse_address=True,
        )

    @property
    def port(self) -> int:
        assert self._listening is not None  # started
        port: int = self._listening.sockets[0].getsockname()[1]
        return port


_EARLY: Final = 1 << 20  # bytes taken for a connection before its handler has it


def _waiting(handler: RequestHandler | LeanConnection) -> bool:
    if isinstance(handler, LeanConnection):
        return handler.idle
    # Waiting for a request's headers (the first or the next on a kept-alive connection):
    # the state aiohttp's own keep-alive closes on. `_waiter` is its private future.
    waiter = getattr(handler, "_waiter", None)
    if waiter is not None:
        return not waiter.done()
    # Or not started yet: before Python 3.12 the handler's task first runs a loop turn after
    # `connection_made`, and a burst the listener accepts at once is admitted in one turn --
    # without this, its last ones would find the first "busy" and be refused, not make room.
    task = getattr(handler, "_task_handler", None)
    return task is not None and inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED


class _Book:
    """The open connections of one listener: every one until its transport is gone, the
    strangers' per source address, those in their TLS handshake, oldest first."""

    def __init__(self, bounds: Bounds, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.clock = clock
        self.all: OrderedDict[_Bounded, None] = OrderedDict()
        self.by_source: dict[str, OrderedDict[_Bounded, None]] = {}  # all but members'
        self.handshaking: OrderedDict[_Bounded, None] = OrderedDict()
        self.handshaking_from: dict[str, OrderedDict[_Bounded, None]] = {}
        self.refused = 0
        self._refusals = PerSourceRate(per_s=0.1, burst=1)  # one log line per 10 s
        # Addresses a member has connected from (a certificate of the CA): their handshakes
        # are not rationed. Bounded: the oldest go first past `PerSourceRate.MAX_KEYS`.
        self.member_sources: OrderedDict[str, None] = OrderedDict()
        rate = bounds.stranger_handshakes_per_s
        self._stranger_rate = PerSourceRate(per_s=rate, burst=max(1, int(4 * rate)))
        self._strangers_rate = PerSourceRate(per_s=4 * rate, burst=max(1, int(16 * rate)))

    def admit(self, conn: _Bounded, tls: bool) -> bool:
        """Make room for `conn` (evicting an idle connection over a cap); False: refused."""
        if tls and not self._admit_handshake(conn):
            return self._refuse(conn.source, "too many TLS handshakes")
        mine = self.by_source.get(conn.source, OrderedDict())
        for pool, cap in (
            (mine, self.bounds.max_per_source),
            (self.all, self.bounds.max_connections),
        ):
            if len(pool) >= cap and not _evict(pool):
                return self._refuse(conn.source, "every connection is busy")
        self.by_source[conn.source] = mine
        mine[conn] = None
        self.all[conn] = None
        if tls:
            self.handshaking[conn] = None
            self.handshaking_from.setdefault(conn.source, OrderedDict())[conn] = None
        return True

    def _admit_handshake(self, conn: _Bounded) -> bool:
        # A member's address is not rationed (a stranger sharing it competes with it on the
        # loop, within the listener's handshake cap); any other address is.
        source = conn.source
        if source in self.member_sources:
            self.member_sources.move_to_end(source)
        elif not (
            self._stranger_rate.allow(source, now := self.clock())
            and self._strangers_rate.allow("*", now)
        ):
            return False
        else:
            mine = self.handshaking_from.get(source)
            if (
                mine is not None
                and len(mine) >= self.bounds.handshakes_per_source
                and not self._evict_stale(mine)
            ):
                return False
        return len(self.handshaking) < self.bounds.handshakes or self._evict_stale(self.handshaking)

    def _evict_stale(self, handshaking: Mapping[_Bounded, None]) -> bool:
        # The oldest handshake in progress makes room only once it has taken over `STALE_S`:
        # a handshake takes milliseconds, a stranger's partial ClientHello holds on. A newer
        # one is never evicted for a newcomer, which could be the same flood's next one.
        oldest = next(iter(handshaking))
        if self.clock() - oldest.started < STALE_S:
            return False
        oldest.evict()
        return True

    def _refuse(self, source: str, why: str) -> bool:
        self.refused += 1
        if self._refusals.allow("log"):
            log.warning("refusing connections from %s: %s (%d refused)", source, why, self.refused)
        return False

    def secured(self, conn: _Bounded, member: bool) -> None:
        """`conn`'s handshake is done; a member's connection leaves its address's pool."""
        self._handshake_done(conn)
        if member:
            self._leave_source(conn)
            self.member_sources[conn.source] = None
            self.member_sources.move_to_end(conn.source)
            while len(self.member_sources) > PerSourceRate.MAX_KEYS:
                self.member_sources.popitem(last=False)

    def forget(self, conn: _Bounded) -> None:
        """`conn`'s descriptor is gone (or about to be: aborted)."""
        self.all.pop(conn, None)
        self._leave_source(conn)
        self._handshake_done(conn)

    def _leave_source(self, conn: _Bounded) -> None:
        mine = self.by_source.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_source[conn.source]

    def _handshake_done(self, conn: _Bounded) -> None:
        self.handshaking.pop(conn, None)
        mine = self.handshaking_from.get(conn.source)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.handshaking_from[conn.source]


def _evict(pool: OrderedDict[_Bounded, None]) -> bool:
    for conn in pool:
        if conn.idle and not conn.member:
            conn.evict()
            return True
    return False


class _Bounded(asyncio.Protocol):
    """aiohttp's handler behind the listener's caps: connects only once admitted and, on a
    TLS listener, once its handshake is done."""

    def __init__(
        self,
        handler: RequestHandler | LeanConnection,
        book: _Book,
        tls: ssl.SSLContext | None,
        handshake_s: float,
        lean: tuple[str, LeanApp] | None = None,
    ) -> None:
        self.handler = handler
        self._lean = lean  # (ALPN name, app): who serves a connection that agreed on it
        self.book = book
        self.source = ""
        self.admitted = False
        self.member = False  # its client presented a certificate of the cluster's CA
        self.started = book.clock()
        self._tls = tls
        self._handshake_s = handshake_s
        self._raw: asyncio.Transport | None = None  # while its TLS handshake runs
        self._transport: asyncio.Transport | None = None  # the handler's, once connected
        self._handshake: asyncio.Task[None] | None = None
        # What TLS delivered between the handshake's end and `_connect` (a client speaks
        # as soon as its side is done), handed to the handler then. Bounded by `_EARLY`.
        self._early: list[bytes] = []
        self._early_eof = False
        self._overflow = False

    @property
    def idle(self) -> bool:
        """Whether no whole request is being served: in its handshake, closing, or waiting
        for headers."""
        if self._raw is not None:
            return True
        transport = self._transport
        return transport is not None and (transport.is_closing() or _waiting(self.handler))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream server's
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self.admitted = self.book.admit(self, self._tls is not None)
        if not self.admitted:
            transport.abort()
        elif self._tls is None:
            self._connect(transport)
        else:
            # Nothing is read until the handshake task has put TLS in place: a ClientHello
            # read before that would come to this protocol and be lost.
            transport.pause_reading()
            self._raw = transport
            self._handshake = asyncio.get_running_loop().create_task(self._secure(transport))

    async def _secure(self, raw: asyncio.Transport) -> None:
        assert self._tls is not None  # a TLS listener's
        loop = asyncio.get_running_loop()
        try:
            secure = await loop.start_tls(
                raw,
                self,
                self._tls,
                server_side=True,
                ssl_handshake_timeout=self._handshake_s,
                # A graceful close waits this long for the peer's close_notify, holding the
                # descriptor (and its place in the book) meanwhile.
                ssl_shutdown_timeout=min(self._handshake_s, SHUTDOWN_S),
            )
        except Exception as exc:  # a failed, timed-out or evicted handshake: nothing to serve
            log.debug("TLS handshake from %s failed: %r", self.source, exc)
            secure = None
        finally:
            self._raw = None
        if secure is None:
            self.book.forget(self)
            raw.abort()
            return
        self.member = bool(secure.get_extra_info("peercert"))  # verified against the CA
        self.book.secured(self, self.member)
        if self._lean is not None:
            ssl_object = secure.get_extra_info("ssl_object")
            if ssl_object is not None and ssl_object.selected_alpn_protocol() == self._lean[0]:
                self.handler = LeanConnection(self._lean[1])  # aiohttp's never connected
        self._connect(secure)

    def _connect(self, transport: asyncio.Transport) -> None:
        if self._overflow:
            self.book.forget(self)
            transport.abort()
            return
        self._transport = transport
        self.handler.connection_made(transport)
        early, self._early = self._early, []
        for data in early:
            self.handler.data_received(data)
        if self._early_eof:
            self.handler.eof_received()

    def evict(self) -> None:
        """Abort it now: its descriptor is released on the loop's next turn."""
        self.book.forget(self)
        if self._raw is not None:
            self._raw.abort()  # the handshake fails; `_secure` ends
        elif self._transport is not None:
            self._transport.abort()  # the handler hears connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.book.forget(self)
        if self._transport is not None:
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self.handler.data_received(data)
        elif self.admitted and sum(map(len, self._early)) + len(data) <= _EARLY:
            self._early.append(data)
        else:  # more than any first read could be: `_connect` closes it instead
            self._early_eof = self._overflow = True

    def eof_received(self) -> None:
        if self._transport is not None:
            self.handler.eof_received()
        else:
            self._early_eof = True

    def pause_writing(self) -> None:
        if self._transport is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self._transport is not None:
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
