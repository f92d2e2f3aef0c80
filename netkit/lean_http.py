"""A small HTTP/1.1 server over llhttp (`httptools`) for the facade's hot path (issue 33).

aiohttp's application stack cost the facade about a third of its time per request: a
request object with lazy properties, a router, three middlewares, signals, a response
object prepared through a payload writer. This server is what uvicorn's is: an
`asyncio.Protocol` feeding llhttp, a task per request, the answer written in one `write`.
It serves one application -- a handler taking a `LeanRequest` -- with the bounds every
nvpair listener keeps (`netkit.sites`, issue 12) and its own:

- the request line and headers: at most `MAX_URL` bytes of target, `MAX_FIELD` of a header
  name or value, `MAX_HEADERS` headers and `MAX_HEAD` bytes in all (431 past the last two,
  414 past the first, 400 for a field); the connection is closed after the answer;
- the body: at most what `body_limit(method, path)` says, refused by its `Content-Length`
  before any of it is read, else as soon as it passes (the application's 413); the whole
  body is read before the handler runs;
- time: headers must arrive, and a kept-alive connection may stay idle, at most `idle_s`;
  a body must have arrived `body_s` after its headers; past either the connection is closed
  (a request whose body is late gets no answer, as aiohttp's deadline closed it too);
- pipelining: requests are answered in order, one at a time; while one runs, at most
  `MAX_AHEAD` more are parsed and held, then the connection stops being read;
- a client that goes away cancels its request's handler (the job is then cancelled);
- streamed answers (`LeanStream`) are chunked and wait while the client does not read
  (the transport's high-water mark), so a slow reader holds no more than that in memory.

The connection caps, the per-source caps and idle eviction are `netkit.sites`' book, which
wraps each connection here as it wraps aiohttp's (`netkit.lean_sites.start_lean`).

A handler answers with an aiohttp `web.Response` (its status, reason, headers and bytes are
written as they are: the facade's OpenAI-shaped errors stay byte for byte) or with a
`LeanStream` it has prepared, written and ended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Final, TypeAlias
from urllib.parse import unquote_to_bytes

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "MAX_AHEAD",
    "MAX_FIELD",
    "MAX_HEAD",
    "MAX_HEADERS",
    "MAX_URL",
    "Answer",
    "LeanAnswer",
    "LeanApp",
    "LeanConnection",
    "LeanRequest",
    "LeanStream",
]

log = logging.getLogger(__name__)

MAX_URL: Final = 8190  # bytes of a request target (aiohttp's max_line_size)
MAX_FIELD: Final = 8190  # bytes of one header's name or value (aiohttp's max_field_size)
MAX_HEADERS: Final = 128  # headers of one request
MAX_HEAD: Final = 64 * 1024  # bytes of all of a request's headers together
MAX_AHEAD: Final = 4  # pipelined requests parsed and held while one runs
HIGH_WATER: Final = 256 * 1024  # bytes of a streamed answer buffered before it waits
LINGER_S: Final = 5.0  # a refused request's body is read and dropped this long at most
LINGER_BYTES: Final = 64 * 1024 * 1024  # ... and this much

_REASONS: Final = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
    413: "Payload Too Large", 414: "URI Too Long", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout",
}  # fmt: skip


@dataclass(slots=True)
class LeanAnswer:
    """A whole answer built for this server (no aiohttp object): its status, its headers
    (`Content-Length` and `Date` are added) and its body."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


Answer: TypeAlias = "web.StreamResponse | LeanStream | LeanAnswer"  # what a handler returns


class _Refused(Exception):
    """A request the server refuses before its handler: the status and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LeanApp:
    """What the server serves: the handler, and the application's own words for the
    answers the server gives itself (so they are in the application's shape)."""

    handler: Callable[[LeanRequest], Awaitable[Answer]]
    body_limit: Callable[[str, str], int]  # (method, path) -> bytes a body may have
    refusal: Callable[[int, str], web.Response]  # (status, message) -> the answer
    on_answer: Callable[[LeanRequest, MutableMapping[str, str]], None] = lambda _r, _h: None
    idle_s: float = 30.0
    body_s: float = 60.0


class LeanRequest:
    """What a handler gets: the subset of `aiohttp.web.BaseRequest` the facade reads, with
    the body already read (bounded), and a place for the handler's own values."""

    __slots__ = (
        "_state", "body", "headers", "keep_alive", "method", "path", "query_string",
        "transport", "version",
    )  # fmt: skip

    def __init__(
        self,
        method: str,
        target: tuple[str, str],  # the path and the query (`_target_of`)
        headers: CIMultiDictProxy[str],
        body: bytes,
        transport: asyncio.Transport | None,
        keep_alive: bool,
        version: str,
    ) -> None:
        self.method = method
        self.path, self.query_string = target
        self.headers = headers
        self.body = body
        self.transport = transport
        self.keep_alive = keep_alive
        self.version = version
        self._state: dict[object, Any] = {}

    @property
    def host(self) -> str:
        """The `Host` header, as aiohttp's `request.host` gives it."""
        return self.headers.get("Host", "")

    @property
    def content_length(self) -> int:
        """The body's length (it is read whole before the handler runs)."""
        return len(self.body)

    def __getitem__(self, key: object) -> Any:
        return self._state[key]

    def __setitem__(self, key: object, value: Any) -> None:
        self._state[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def get(self, key: object, default: Any = None) -> Any:
        """The handler's value under `key`, or `default`."""
        return self._state.get(key, default)


class LeanStream:
    """A streamed answer (chunked), as `aiohttp.web.StreamResponse` is written: `prepare`,
    `write` each piece, `write_eof`."""

    def __init__(self, *, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers)
        self._connection: LeanConnection | None = None
        self.prepared = False
        self.ended = False

    async def prepare(self, request: LeanRequest) -> None:
        """Send the head."""
        connection = request.get(_CONNECTION)
        if not isinstance(connection, LeanConnection):
            raise RuntimeError("a LeanStream answers a LeanRequest")
        self._connection = connection
        self.headers["Transfer-Encoding"] = "chunked"
        connection.write_head(request, self.status, "", self.headers)
        self.prepared = True

    async def write(self, data: bytes) -> None:
        """Send a piece; waits while the client is not reading."""
        assert self._connection is not None, "prepare() first"
        if data:
            await self._connection.write_body(b"%x\r\n%b\r\n" % (len(data), data))

    async def write_eof(self, data: bytes = b"") -> None:
        """Send the last piece and end the answer."""
        if self.ended:
            return
        if data:
            await self.write(data)
        assert self._connection is not None, "prepare() first"
        self.ended = True
        await self._connection.write_body(b"0\r\n\r\n")


_CONNECTION: Final = object()  # the request's key to its connection (for LeanStream)
_date_cache: list[Any] = [0, b""]


def _date() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0], _date_cache[1] = now, formatdate(now, usegmt=True).encode()
    value: bytes = _date_cache[1]
    return value


def _target_of(target: bytes) -> tuple[str, str]:
    """A request target's path (percent-decoded) and query, as aiohttp's request gives them;
    an absolute-form target (`http://host/path`) is parsed for its path too."""
    url = httptools.parse_url(target) if target[:1] != b"/" or b"?" in target else None
    raw = url.path if url is not None and url.path is not None else target
    query = url.query.decode("latin-1") if url is not None and url.query else ""
    path = unquote_to_bytes(raw) if b"%" in raw else raw
    return path.decode("utf-8", "replace"), query


class LeanConnection(asyncio.Protocol):
    """One client connection: llhttp fed as bytes arrive, one request answered at a time."""

    def __init__(self, app: LeanApp) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._ahead: collections.deque[LeanRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # for the deadline, or an earlier one
        self._due: float | None = None  # the idle or body deadline (loop time)
        self._why = ""
        self._after_s = 0.0
        self._drained: asyncio.Future[None] | None = None  # while the client does not read
        self._reading = True
        self._closing = False
        self._eof = False  # the client sent all it will
        self._lingering = -1  # bytes dropped since a refusal (-1: none was made)
        self._closing_after = False  # the answers in flight go, then the connection closes
        self._in_message = False  # between a request's first byte and its end
        self._busy = False  # a request's headers are in: not idle (netkit.sites' eviction)
        self._reset()

    def _reset(self) -> None:
        self._target = bytearray()
        self._where = ("/", "")  # the target's path and query, once its headers are in
        self._fields: list[tuple[str, str]] = []
        self._head = 0
        self._body: list[bytes] = []
        self._size = 0
        self._limit = 0

    # -- what netkit.sites' book asks --------------------------------------------------------

    @property
    def serving(self) -> asyncio.Task[None] | None:
        """The task answering the current request, if one is."""
        return self._task

    @property
    def idle(self) -> bool:
        """No request is being read or served: waiting for headers, or between requests."""
        return not self._busy and self._task is None and not self._ahead

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)
        self._arm(self.app.idle_s, "sent no request")

    def data_received(self, data: bytes) -> None:
        if self._closing_after:
            return  # after an upgrade request: nothing more is read
        if self._closing:
            if self._lingering >= 0:  # after a refusal: read and dropped, bounded
                self._lingering += len(data)
                if self._lingering > LINGER_BYTES:
                    self._abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade is not taken (RFC 9110 7.8 lets a server ignore it): the request is
            # answered as HTTP/1.1 and the connection closed after, since what the client
            # sends next is in the protocol it asked for.
            if self._task is None and not self._ahead:
                self._refuse(400, "this server does not switch protocols")
            else:
                self._eof = True
                self._closing_after = True
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, _Refused) else None
            if cause is not None:
                self._refuse(cause.status, str(cause))
            else:
                self._refuse(400, f"malformed request: {str(exc)[:100]}")
        if len(self._ahead) >= MAX_AHEAD and self._reading and self.transport is not None:
            self.transport.pause_reading()
            self._reading = False

    def eof_received(self) -> None:
        # The client sent all it will: a FIN, which a client that half-closes and one that
        # went alike send. Taken as gone (the connection closes, a handler in flight is
        # cancelled), so an engine does not go on generating for nobody.
        self._eof = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.transport = None
        self._stop_timer()
        self._ahead.clear()
        if self._task is not None:
            self._task.cancel()  # the client went: its request's handler is cancelled
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- llhttp's callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._reset()

    def on_url(self, url: bytes) -> None:
        self._target += url
        if len(self._target) > MAX_URL:
            raise _Refused(414, f"the request target is over {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD:
            raise _Refused(400, f"a header name or value is over {MAX_FIELD} bytes")
        self._head += len(name) + len(value)
        if len(self._fields) >= MAX_HEADERS or self._head > MAX_HEAD:
            raise _Refused(431, f"over {MAX_HEADERS} headers or {MAX_HEAD} bytes of them")
        self._fields.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._busy = True
        method = self._parser.get_method().decode("latin-1")
        try:
            self._where = _target_of(bytes(self._target))
        except httptools.HttpParserInvalidURLError:
            raise _Refused(400, "the request target is not a URL") from None
        self._limit = self.app.body_limit(method, self._where[0])
        declared = next((v for k, v in self._fields if k.lower() == "content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            raise _Refused(413, f"the body is over {self._limit} bytes")
        expect = next((v for k, v in self._fields if k.lower() == "expect"), "")
        if expect.lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self._task is None:  # a pipelined request's body is not on the clock yet
            self._arm(self.app.body_s, "took too long to send a body")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._limit:
            raise _Refused(413, f"the body is over {self._limit} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        version = self._parser.get_http_version()
        request = LeanRequest(
            self._parser.get_method().decode("latin-1"),
            self._where,
            CIMultiDictProxy(CIMultiDict(self._fields)),
            b"".join(self._body) if len(self._body) != 1 else self._body[0],
            self.transport,
            bool(self._parser.should_keep_alive()),
            version,
        )
        request[_CONNECTION] = self
        self._reset()
        self._ahead.append(request)
        if self._task is None:
            self._next()

    # -- serving ----------------------------------------------------------------------------

    def _next(self) -> None:
        if self._closing:
            if self.transport is not None and self._lingering < 0:
                self.transport.close()
            return
        if not self._ahead:
            if self._eof:
                self._close()
                return
            self._busy = self._in_message
            if self._in_message:  # the next request came in part while this one ran
                self._arm(self.app.body_s, "took too long to send a request")
            else:
                self._arm(self.app.idle_s, "sent no next request")
            if not self._reading and self.transport is not None:
                self.transport.resume_reading()
                self._reading = True
            return
        self._disarm()
        request = self._ahead.popleft()
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: LeanRequest) -> None:
        try:
            answer = await self.app.handler(request)
            if isinstance(answer, LeanStream):
                if not answer.prepared:
                    raise RuntimeError("a LeanStream answer was never prepared")
                await answer.write_eof()
            else:
                self._write_whole(request, answer)
        except asyncio.CancelledError:
            if self.transport is not None:  # cancelled from outside (closing): cut it
                self.transport.abort()
            raise
        except ConnectionError as exc:
            log.debug("an answer could not be written: %r", exc)
            self._abort()
            return
        except Exception:
            log.exception("the facade's handler failed")
            if not request.get(_HEAD_SENT) and self.transport is not None:
                self._write_whole(request, self.app.refusal(500, "internal error"))
                self._close()
            else:
                self._abort()  # part of an answer went: the client sees it cut
            return
        finally:
            self._task = None
        if not request.keep_alive or self._eof:
            self._close()
            return
        self._next()

    def write_head(
        self, request: LeanRequest, status: int, reason: str, headers: CIMultiDict[str]
    ) -> None:
        """Write an answer's status line and headers (`on_answer` adds its own first)."""
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        self.transport.write(self._head_of(request, status, reason, headers))

    def _head_of(
        self,
        request: LeanRequest,
        status: int,
        reason: str,
        headers: CIMultiDict[str],
    ) -> bytes:
        self.app.on_answer(request, headers)
        if "Content-Type" not in headers:
            headers["Content-Type"] = "application/octet-stream"
        if not request.keep_alive:
            headers["Connection"] = "close"
        lines = [b"HTTP/1.1 %d %s" % (status, (reason or _REASONS.get(status, "")).encode())]
        lines += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
        lines.append(b"Date: " + _date())
        request[_HEAD_SENT] = True
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def write_body(self, data: bytes) -> None:
        """Write a piece of a streamed answer, waiting while the client does not read."""
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        self.transport.write(data)
        if self._drained is not None and not self._drained.done():
            await self._drained

    def _write_whole(self, request: LeanRequest, answer: web.StreamResponse | LeanAnswer) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        if isinstance(answer, LeanAnswer):  # the hot path: an engine's answer passed on
            answer.headers["Content-Length"] = str(len(answer.body))
            head = self._head_of(request, answer.status, "", answer.headers)
            self._write_once(request, head, answer.body)
            return
        if not isinstance(answer, web.Response):
            raise RuntimeError("an aiohttp answer other than web.Response")
        body = answer.body
        if body is None:
            body = b""
        elif not isinstance(body, bytes | bytearray):
            raise RuntimeError("a web.Response whose body is not bytes")
        headers = CIMultiDict(answer.headers)
        headers.popall("Transfer-Encoding", None)
        headers["Content-Length"] = str(len(body))
        self._write_once(request, self._head_of(request, answer.status, answer.reason, headers),
                         bytes(body))  # fmt: skip

    def _write_once(self, request: LeanRequest, head: bytes, body: bytes) -> None:
        # One write, one system call: on loopback a send costs as much as the rest of the
        # answer's work together.
        assert self.transport is not None
        self.transport.write(head + body if body and request.method != "HEAD" else head)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the server refuses itself, then close (what the client still
        sends is dropped)."""
        self._closing = True
        self._disarm()
        transport = self.transport
        if transport is None:
            return
        if self._task is not None:  # a pipelined request is bad: the one running ends first
            self._ahead.clear()
            return  # `_next` closes once it has
        answer = self.app.refusal(status, message)
        request = LeanRequest("GET", ("/", ""), CIMultiDictProxy(CIMultiDict()), b"", transport,
                              False, "1.1")  # fmt: skip
        request[_CONNECTION] = self
        with contextlib.suppress(ConnectionError):
            self._write_whole(request, answer)
        # Closing now, with the client's body still coming, would reset the connection
        # (unread data) before it reads the answer. So the answer goes, then our side is
        # shut, and what still comes is read and dropped -- `LINGER_S` and `LINGER_BYTES`
        # at most, as nginx's lingering close does.
        if transport.can_write_eof():
            transport.write_eof()
            self._lingering = 0
            self._arm(LINGER_S, "lingered after a refusal")
        else:
            transport.close()

    def _close(self) -> None:
        self._closing = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        self._closing = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()

    # -- time ------------------------------------------------------------------------------

    # One timer per connection, moved only when it fires: a request re-arms the deadline
    # twice (its body, then the idle wait for the next), and a timer made and cancelled for
    # each was a fortieth of the facade's time per request.

    def _arm(self, after_s: float, why: str) -> None:
        due = self._loop.time() + after_s
        self._due, self._why, self._after_s = due, why, after_s
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = self._loop.call_at(due, self._check)

    def _disarm(self) -> None:
        self._due = None  # the timer, when it fires, finds nothing due

    def _stop_timer(self) -> None:
        self._due = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._due = None
        if self._task is not None:
            return  # a request is being served: its own bounds hold
        if self._lingering < 0:
            log.info("closing a connection that %s within %g s", self._why, self._after_s)
        self._abort()


_HEAD_SENT: Final = object()  # the request's key: its answer's head is on the wire
