"""A burst of connections the listener accepts at once, for real on 127.0.0.1: the newest
make room by closing the oldest that have sent no request yet, even when those were admitted
in the same loop turn (before Python 3.12 their handlers had not run yet, and the book took
them for busy: the burst's last connections were refused while its first ones stayed)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from netkit.sites import start_runner
from tests.fixtures.waiting import TIMEOUT_S, eventually

CAP = 4  # connections the listener holds (and from one address)
GET = b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
SLOW = b"POST /slow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"


@contextlib.asynccontextmanager
async def _listener(reading: list[object]) -> AsyncIterator[int]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def slow(request: web.Request) -> web.Response:
        reading.append(request)
        await request.read()  # the rest of the body never comes: a whole request, busy
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_post("/slow", slow)
    with pytest.MonkeyPatch.context() as env:
        env.setitem(os.environ, "NVPAIR_MAX_CONNECTIONS", str(CAP))
        runner, port = await start_runner(app, "127.0.0.1", 0)
    try:
        yield port
    finally:
        await runner.cleanup()


async def _answer(sock: socket.socket) -> bytes:
    """What the server sent before closing (b"" for a reset or a close with nothing)."""
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
    except ConnectionResetError:
        return b""
    try:
        return await asyncio.wait_for(reader.readuntil(b"hello"), TIMEOUT_S)
    except (ConnectionResetError, asyncio.IncompleteReadError):
        return b""
    finally:
        writer.close()


async def test_a_burst_accepted_at_once_makes_room_from_its_first_ones() -> None:
    reading: list[object] = []
    async with _listener(reading) as port:
        busy = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP - 2)]
        try:
            await _burst(busy, reading, port)
        finally:
            for _, writer in busy:
                writer.close()


async def _burst(
    busy: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]], reading: list[object], port: int
) -> None:
    for _, writer in busy:
        writer.write(SLOW)
    await eventually(lambda: len(reading) == CAP - 2, "the slow requests are being served")

    # Four connections complete in the kernel's backlog while the loop does not run, each
    # with a whole request sent: the listener accepts them in one turn.
    burst = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(GET)
        sock.setblocking(False)
        burst.append(sock)
    answers = await asyncio.gather(*(_answer(sock) for sock in burst))

    # Two places were free; the third and fourth closed the first and second (which had
    # sent no request the server had read), not refused.
    assert [a.endswith(b"hello") for a in answers] == [False, False, True, True]
    assert all(not reader.at_eof() for reader, _ in busy)  # the busy ones were kept
