"""`netkit.lean_http` behind `netkit.lean_sites.start_lean`, for real on 127.0.0.1: its bounds.

Each refusal is paired with a control that is answered: an oversized header, too many
headers, a long target, a body over its limit (declared, or chunked and found on the way --
the answer still reaches the client), a malformed request, a connection that sends nothing,
a body that never ends, a client that goes away mid-request (its handler is cancelled), the
connection caps (an idle connection makes room, a busy one does not), pipelined requests,
`Expect: 100-continue` and a streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web

from netkit.lean_http import MAX_FIELD, MAX_HEADERS, MAX_URL, LeanApp, LeanRequest, LeanStream
from netkit.lean_sites import LeanServer, start_lean
from tests.fixtures.waiting import TIMEOUT_S, eventually

LIMIT = 1000  # bytes a body may have


class App:
    """A handler that echoes, one that never answers, one that streams; what happened."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.hanging = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def handle(self, request: LeanRequest) -> web.StreamResponse | LeanStream:
        self.seen.append(request.path)
        if request.path == "/hang":
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/stream":
            stream = LeanStream(headers=[("Content-Type", "text/event-stream")])
            await stream.prepare(request)
            for i in range(3):
                await stream.write(b"data: %d\n\n" % i)
            await stream.write_eof()
            return stream
        return web.Response(body=b"echo:" + request.body, content_type="text/plain")


def refusal(status: int, message: str) -> web.Response:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"}})
    return web.Response(status=status, body=body, content_type="application/json")


@contextlib.asynccontextmanager
async def serving(app: App, **env: str) -> AsyncIterator[LeanServer]:
    lean = LeanApp(handler=app.handle, body_limit=lambda _m, _p: LIMIT, refusal=refusal)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setitem(os.environ, name, value)
        server = await start_lean(lean, "127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose(grace_s=1.0)


async def exchange(port: int, data: bytes, *, until_close: bool = True) -> bytes:
    """Send `data`; what the server answers until it closes (or one answer's head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if until_close:
            return await asyncio.wait_for(reader.read(), TIMEOUT_S)
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
    finally:
        writer.close()


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


CONTROL = post("/ok", b"hi", "Connection: close")


async def test_a_request_is_answered_and_kept_alive() -> None:
    app = App()
    async with serving(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for body in (b"one", b"two"):  # the same connection twice
            writer.write(post("/ok", body))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"Content-Length: 8\r\n" in head
            assert await reader.readexactly(8) == b"echo:" + body
        writer.close()
    assert app.seen == ["/ok", "/ok"]


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ([f"X-Big: {'v' * (MAX_FIELD + 1)}"], b"400"),
        ([f"X-{i}: v" for i in range(MAX_HEADERS + 1)], b"431"),
    ],
    ids=["a-field-too-long", "too-many-headers"],
)
async def test_headers_over_their_bounds_are_refused_in_the_apps_shape(
    extra: list[str], status: bytes
) -> None:
    app = App()
    async with serving(app) as server:
        answer = await exchange(server.port, post("/ok", b"hi", *extra))
        assert answer.startswith(b"HTTP/1.1 " + status)
        assert b'"invalid_request_error"' in answer
        assert app.seen == []  # no handler ran
        assert (await exchange(server.port, CONTROL)).startswith(b"HTTP/1.1 200")


async def test_a_target_over_its_bound_is_414() -> None:
    app = App()
    async with serving(app) as server:
        answer = await exchange(server.port, post("/" + "a" * MAX_URL, b""))
        assert answer.startswith(b"HTTP/1.1 414")
        assert (await exchange(server.port, CONTROL)).startswith(b"HTTP/1.1 200")
    assert app.seen == ["/ok"]


async def test_a_declared_body_over_the_limit_is_413_before_it_is_sent() -> None:
    app = App()
    async with serving(app) as server:
        head = f"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode()
        answer = await exchange(server.port, head)  # no byte of the body sent
        assert answer.startswith(b"HTTP/1.1 413")
        assert b"over 1000 bytes" in answer
        at_limit = await exchange(server.port, post("/ok", b"x" * LIMIT, "Connection: close"))
        assert at_limit.startswith(b"HTTP/1.1 200")  # the control: the limit itself is fine
    assert app.seen == ["/ok"]


async def test_a_chunked_body_found_over_the_limit_is_413_and_the_client_reads_it() -> None:
    # The client goes on sending; closing at once would reset the connection before the
    # answer is read. The server answers, shuts its side and drops the rest.
    app = App()
    async with serving(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /ok HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (600, b"y" * 600)
        for _ in range(40):  # 24 KB, well over the limit, while the answer is on its way
            writer.write(chunk)
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), TIMEOUT_S)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413")
    assert app.seen == []


async def test_a_malformed_request_is_400_and_an_upgrade_is_not_taken() -> None:
    app = App()
    async with serving(app) as server:
        assert (await exchange(server.port, b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.1 400")
        upgrade = (
            b"GET /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        # Answered as HTTP/1.1, then closed: what follows would be the other protocol.
        answered = await exchange(server.port, upgrade + b"\x81\x05hello")
        assert answered.startswith(b"HTTP/1.1 200")
        assert answered.count(b"HTTP/1.1") == 1
        connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
        assert (await exchange(server.port, connect)).startswith(b"HTTP/1.1 400")
        assert (await exchange(server.port, CONTROL)).startswith(b"HTTP/1.1 200")
    assert app.seen == ["/up", "/ok"]


async def test_a_silent_connection_and_a_body_that_never_ends_are_closed() -> None:
    app = App()
    env = {"NVPAIR_IDLE_TIMEOUT_S": "0.3", "NVPAIR_BODY_TIMEOUT_S": "0.3"}
    async with serving(app, **env) as server:
        silent = await asyncio.open_connection("127.0.0.1", server.port)
        late = await asyncio.open_connection("127.0.0.1", server.port)
        late[1].write(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        # The control: a whole request on a third connection is answered meanwhile.
        assert (await exchange(server.port, CONTROL)).startswith(b"HTTP/1.1 200")
        for reader, writer in (silent, late):
            assert await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""  # closed, no answer
            writer.close()
    assert app.seen == ["/ok"]


@pytest.mark.parametrize("leaves", ["closes", "half-closes"])
async def test_a_client_that_goes_away_cancels_its_handler(leaves: str) -> None:
    # A client that only shuts its sending side after a request cannot be told from one
    # that went (both are a FIN): either way its handler is cancelled, so an engine does not
    # go on generating for nobody. While the connection stays open, the handler runs on.
    app = App()
    async with serving(app) as server:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post("/hang", b""))
        await asyncio.wait_for(app.hanging.wait(), TIMEOUT_S)
        assert not app.cancelled.is_set()
        if leaves == "closes":
            writer.close()
        else:
            writer.write_eof()
        await asyncio.wait_for(app.cancelled.wait(), TIMEOUT_S)
        writer.close()


async def test_an_idle_connection_makes_room_and_busy_ones_do_not() -> None:
    app = App()
    async with serving(app, NVPAIR_MAX_CONNECTIONS="2") as server:
        busy = await asyncio.open_connection("127.0.0.1", server.port)
        busy[1].write(post("/hang", b""))
        await asyncio.wait_for(app.hanging.wait(), TIMEOUT_S)
        idle = await asyncio.open_connection("127.0.0.1", server.port)
        await eventually(lambda: len(app.seen) == 1, "the busy one is being served")
        # A third: over the cap, the idle one is closed to make room and it is answered.
        assert (await exchange(server.port, CONTROL)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(idle[0].read(), TIMEOUT_S) == b""
        # Both places are now the busy one's and... a fourth, with the third gone, fits too;
        # but while two busy requests hold both places, a newcomer is refused.
        other = await asyncio.open_connection("127.0.0.1", server.port)
        other[1].write(post("/hang", b""))
        await eventually(lambda: app.seen.count("/hang") == 2, "two busy requests")
        refused = await exchange(server.port, CONTROL)
        assert refused == b""  # closed at once: every connection is busy
        assert not app.cancelled.is_set()  # neither busy one was evicted
        for _, writer in (busy, idle, other):
            writer.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    app = App()
    async with serving(app) as server:
        answer = await exchange(
            server.port, post("/a", b"1") + post("/b", b"2") + post("/c", b"3", "Connection: close")
        )
    assert [part.split(b"echo:")[1][:1] for part in answer.split(b"HTTP/1.1 200")[1:]] == [
        b"1",
        b"2",
        b"3",
    ]
    assert app.seen == ["/a", "/b", "/c"]


async def test_expect_100_continue_gets_its_interim_answer() -> None:
    app = App()
    async with serving(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(7) == b"echo:hi"
        writer.close()


async def test_a_streamed_answer_is_chunked() -> None:
    app = App()
    async with serving(app) as server:
        get = b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = await exchange(server.port, get)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in range(3)) + b"0\r\n\r\n"


async def test_an_absolute_form_target_is_read_for_its_path_and_bounded_by_it() -> None:
    app = App()
    async with serving(app) as server:
        absolute = post("/ok", b"hi", "Connection: close").replace(
            b"POST /ok", b"POST http://x/o%6B?q=1"
        )
        assert (await exchange(server.port, absolute)).startswith(b"HTTP/1.1 200")
        bad = b"POST http://[::1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        assert (await exchange(server.port, bad)).startswith(b"HTTP/1.1 400")
    assert app.seen == ["/ok"]
