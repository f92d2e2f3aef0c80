"""HTTP/1.1 to this node's engines on kept-alive connections: the facade's hot path.

Every request the facade runs on a local engine is one exchange with a server on
127.0.0.1. aiohttp's client spent about 220 µs of CPU on each (request and response
objects, cookie and tracing hooks, timeouts rebuilt per call); this client writes the
request in one `write`, parses the answer with llhttp (`httptools`, the parser uvicorn
uses) and costs about 90 µs. It is deliberately small: `POST` with a body already held,
answers read whole or streamed chunk by chunk, connections reused while the engine keeps
them alive, nothing else. Engines reached over `https` keep using aiohttp.

The same client carries requests forwarded to another member (`agent.cluster.node_client`):
given `Tls` (the cluster's client context, the member's server hostname and a check of the
certificate it presented -- its pin), a connection is made with TLS, checked once when made,
and kept for requests to that member only, so no request pays for TLS set-up or a context.

What relay code reads of an answer is the subset of `aiohttp.ClientResponse` it used:
`status`, `headers`, `content_type`, `content_length`, `read()` and `content.iter_any()`;
failures raise what aiohttp raises (`ServerDisconnectedError`, `ClientPayloadError`,
`TimeoutError`, the `OSError` of a refused connection), so the job errors stay the same.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import httptools  # llhttp bindings
import msgspec
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["EngineHttp", "EngineReply", "Tls"]

CONNECT_TIMEOUT_S: Final = 5.0
READ_TIMEOUT_S: Final = 300.0  # between two pieces of an answer (a long generation streams)
IDLE_S: Final = 2.0  # a kept connection idle longer is closed, not reused (uvicorn: 5 s)
MAX_IDLE: Final = 64  # kept connections per engine
HIGH_WATER: Final = 1 << 20  # body bytes buffered before the engine is paused
MAX_HEAD: Final = 64 * 1024  # status line and headers of an answer
MAX_URLS: Final = 256  # engine URLs remembered parsed


class _Connection(asyncio.Protocol):
    """One connection: feeds llhttp, queues the body, says when the answer is whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._loop = asyncio.get_running_loop()
        self._last = 0.0  # when the engine last sent something (or the request went out)
        self._timer: asyncio.TimerHandle | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.reusable = False
        self.got_bytes = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.idle_since = 0.0
        self.closed: asyncio.Future[None] = self._loop.create_future()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last = self._loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(aiohttp.ClientPayloadError("the engine upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed answer from the engine: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._stop_watching()  # a closed connection holds no timer
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.complete:
            self._fail(aiohttp.ServerDisconnectedError())

    # -- llhttp callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD:
            raise httptools.HttpParserError("answer headers too large")
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.reusable = bool(self.parser.should_keep_alive())
        self._wake()  # the read timer stays: it ends itself when it finds the exchange done

    # -- the exchange ---------------------------------------------------------------------------

    def start(self, request: bytes) -> None:
        """Send one request (the connection is idle)."""
        assert self.transport is not None
        self.head = self._loop.create_future()
        self.status, self.raw_headers, self._head_bytes = 0, [], 0
        self.complete = self.reusable = self.got_bytes = False
        self._last = self._loop.time()
        # One timer, moved on only when it fires: a timeout per read would cost a timer
        # (made and cancelled) per chunk of every answer, and one per exchange a timer per
        # request. One left from an earlier exchange watches this one too.
        if self._timer is None:
            self._timer = self._loop.call_at(self._last + READ_TIMEOUT_S, self._watch)
        self.transport.write(request)

    def _watch(self) -> None:
        self._timer = None
        if self.complete or self.transport is None:
            return
        due = self._last + READ_TIMEOUT_S
        if self._loop.time() >= due:
            self._fail(TimeoutError(f"the engine sent nothing for {READ_TIMEOUT_S:g}s"))
        else:
            self._timer = self._loop.call_at(due, self._watch)

    def _stop_watching(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, or None once it is whole."""
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            self.waiter = self._loop.create_future()
            try:
                await self.waiter  # woken by data, the end, a failure or the idle timer
            finally:
                self.waiter = None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        return chunk

    def _fail(self, exc: BaseException) -> None:
        self._stop_watching()
        if self.error is None:
            self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        self._stop_watching()
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class _Body:
    """`reply.content`: the body as it comes."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Each piece of the body as it arrives."""
        while (chunk := await self._connection.next_chunk()) is not None:
            yield chunk


class EngineReply:
    """An engine's answer: its head at once, its body read whole or streamed."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = connection.status
        self._headers: CIMultiDictProxy[str] | None = None
        self._items: list[tuple[str, str]] | None = None
        self.content = _Body(connection)

    def header_items(self) -> list[tuple[str, str]]:
        """The answer's headers as sent, decoded once: what the facade passes on reads these,
        without a multidict built per request."""
        if self._items is None:
            self._items = [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in self._connection.raw_headers
            ]
        return self._items

    def _header(self, lowered: str) -> str | None:
        for name, value in self.header_items():
            if name.lower() == lowered:
                return value
        return None

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The answer's headers (decoded when first asked for)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(self.header_items()))
        return self._headers

    @property
    def content_type(self) -> str:
        """The media type without parameters, as aiohttp gives it."""
        raw = self._header("content-type")
        if raw is None:
            return "application/octet-stream"
        return raw.partition(";")[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        """The declared length of the body, if any."""
        raw = self._header("content-length")
        return int(raw) if raw is not None and raw.isdigit() else None

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while (chunk := await self._connection.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def json(self) -> Any:
        """The whole body, decoded as JSON (`msgspec.DecodeError` when it is not)."""
        return msgspec.json.decode(await self.read())


@dataclass(frozen=True, slots=True)
class Tls:
    """How a connection to a member is made and checked: `context` (the cluster's client
    context), `server_hostname` (the member's name in its certificate), and `check`, given
    the connection's SSL object once the handshake is done: whether the peer is the member
    meant (its pin). A connection that fails the check is closed before a byte is sent."""

    context: ssl.SSLContext
    server_hostname: str
    check: Callable[[Any], bool]
    local_addr: tuple[str, int] | None = None


Origin = tuple[str, int, str, int]  # host, port, server hostname, id of the TLS context


class _Exchange:
    """`async with client.post(...) as reply`: the connection goes back when it is done."""

    def __init__(self, client: EngineHttp, origin: Origin, request: bytes, tls: Tls | None) -> None:
        self._client = client
        self._origin = origin
        self._request = request
        self._tls = tls
        self._connection: _Connection | None = None

    async def __aenter__(self) -> EngineReply:
        for attempt in range(2):
            connection, reused = await self._client._acquire(self._origin, self._tls)
            self._connection = connection
            connection.start(self._request)
            assert connection.head is not None
            try:
                await connection.head  # or the idle timer's TimeoutError
            except aiohttp.ServerDisconnectedError:
                connection.close()
                # A kept connection the engine had just closed: it never saw the request
                # (no byte came back), so sending it once more on a fresh one is safe.
                if reused and not connection.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:
                connection.close()  # a timeout, a cancelled handler: the answer is abandoned
                raise
            return EngineReply(connection)
        raise AssertionError("unreachable")  # pragma: no cover

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        connection = self._connection
        if connection is None:
            return
        if exc is None and connection.complete and connection.reusable and not connection.error:
            self._client._release(self._origin, connection)
        else:
            connection.close()


class EngineHttp:
    """Kept-alive HTTP/1.1 connections to local engines (or, with `Tls`, to members), per
    origin."""

    def __init__(self, *, max_idle: int = MAX_IDLE) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()  # every connection not yet lost
        self._max_idle = max_idle
        self._urls: dict[str, tuple[tuple[str, int], str, str]] = {}  # url -> where, parsed
        self.opened = 0  # connections made, for tests: reuse shows as few

    def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        tls: Tls | None = None,
    ) -> _Exchange:
        """POST `body` to `url` + `path` (`url`: `http://host:port`, or `https://...` with
        `tls`) with `headers`."""
        where = self._urls.get(url)
        if where is None:
            parts = urlsplit(url)
            default = 443 if parts.scheme == "https" else 80
            origin = (parts.hostname or "127.0.0.1", parts.port or default)
            where = (origin, parts.path.rstrip("/"), parts.netloc)
            if len(self._urls) >= MAX_URLS:
                self._urls.clear()
            self._urls[url] = where
        origin, prefix, netloc = where
        lines = [f"POST {prefix}{path} HTTP/1.1", f"Host: {netloc}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        key = (*origin, tls.server_hostname, id(tls.context)) if tls else (*origin, "", 0)
        return _Exchange(self, key, head + body, tls)

    async def _acquire(self, origin: Origin, tls: Tls | None) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.transport is not None and now - connection.idle_since < IDLE_S:
                return connection, True
            connection.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if tls is None:
                _, connection = await loop.create_connection(_Connection, *origin[:2])
            else:
                _, connection = await loop.create_connection(
                    _Connection,
                    *origin[:2],
                    ssl=tls.context,
                    server_hostname=tls.server_hostname,
                    local_addr=tls.local_addr,
                )
        if tls is not None:
            transport = connection.transport
            ssl_object = transport.get_extra_info("ssl_object") if transport else None
            if not tls.check(ssl_object):
                connection.close()
                raise aiohttp.ClientConnectionError(
                    f"the server at {origin[0]}:{origin[1]} is not {tls.server_hostname!r}: "
                    "its certificate is not that member's pin"
                )
        self.opened += 1
        self._open.add(connection)
        connection.closed.add_done_callback(lambda _: self._open.discard(connection))
        return connection, False

    def _release(self, origin: Origin, connection: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle or connection.transport is None:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        """Close every connection, and wait until their sockets are."""
        self._idle.clear()
        closing = [connection.closed for connection in self._open]
        for connection in list(self._open):
            connection.close()
        if closing:
            await asyncio.wait(closing, timeout=CONNECT_TIMEOUT_S)
