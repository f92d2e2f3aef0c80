"""`agent.engines.client`: the facade's kept-alive client to local engines, against real servers
on 127.0.0.1 -- reuse, streaming, an engine that closes or lies, and the errors jobs see."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from agent.engines import client as engine_http
from agent.engines.client import EngineHttp
from agent.serving.job_errors import JobError
from agent.serving.relay import for_exception
from tests.workload_manager.cluster_harness import free_port

Raw = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _app_server() -> tuple[web.AppRunner, str]:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {"got": len(body), "type": request.content_type, "key": request.headers.get("X-Key")}
        )

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # chunked: no length
        for i in range(3):
            await response.write(b"data: %d\n\n" % i)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/echo", echo)
    app.router.add_post("/v1/stream", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def app_server() -> AsyncIterator[str]:
    runner, url = await _app_server()
    yield url
    await runner.cleanup()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Raw], Awaitable[str]]]:
    """Start a server speaking whatever bytes `handle` writes; every one closed at the end."""
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def start(handle: Raw) -> str:
        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            await handle(reader, writer)
            await done.wait()  # until the test ends: the test decides when it closes

        server = await asyncio.start_server(tracked, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    done.set()
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()  # their sockets closed
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_requests_reuse_one_kept_connection_and_read_as_aiohttp_does(
    app_server: str,
) -> None:
    client = EngineHttp()
    try:
        for i in range(5):
            headers = {"Content-Type": "application/json", "X-Key": "k"}
            async with client.post(app_server, "/v1/echo", b"x" * i, headers) as reply:
                assert reply.status == 200
                assert reply.content_type == "application/json"
                assert reply.content_length is not None
                assert await reply.json() == {"got": i, "type": "application/json", "key": "k"}
        assert client.opened == 1  # five requests, one connection
        async with client.post(app_server, "/v1/stream", b"{}", {}) as reply:
            assert reply.content_type == "text/event-stream"
            assert reply.content_length is None
            chunks = [chunk async for chunk in reply.content.iter_any()]
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert client.opened == 1
    finally:
        await client.aclose()


async def test_a_kept_connection_the_engine_closed_is_replaced_without_a_failure(
    app_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = EngineHttp()
    try:
        async with client.post(app_server, "/v1/echo", b"a", {}) as reply:
            await reply.read()
        [connection] = client._idle[next(iter(client._idle))]
        # Not marked closed yet: as if the engine's close were still on its way.
        monkeypatch.setattr(engine_http, "IDLE_S", 3600.0)
        assert connection.transport is not None
        connection.transport.abort()  # the engine's idle timeout, seen late
        async with client.post(app_server, "/v1/echo", b"b", {}) as reply:
            assert (await reply.json())["got"] == 1
        assert client.opened == 2
    finally:
        await client.aclose()


async def test_an_engine_that_hangs_up_mid_answer_is_engine_closed(
    raw_server: Callable[[Raw], Awaitable[str]],
) -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    url = await raw_server(half)
    client = EngineHttp()
    try:
        async with client.post(url, "/v1/x", b"{}", {}) as reply:
            assert reply.status == 200
            with pytest.raises(aiohttp.ServerDisconnectedError) as caught:
                await reply.read()
        assert for_exception(caught.value, local=True) is JobError.ENGINE_CLOSED
        assert all(not idle for idle in client._idle.values())  # not kept for reuse
    finally:
        await client.aclose()


async def test_garbage_for_an_answer_is_a_payload_error_and_a_refused_port_is_refused(
    raw_server: Callable[[Raw], Awaitable[str]],
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    url = await raw_server(garbage)
    client = EngineHttp()
    try:
        with pytest.raises(aiohttp.ClientPayloadError) as caught:
            async with client.post(url, "/v1/x", b"{}", {}):
                pass
        assert for_exception(caught.value, local=True) is JobError.ENGINE_CLOSED
        closed = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(ConnectionRefusedError) as refused:
            async with client.post(closed, "/v1/x", b"{}", {}):
                pass
        assert for_exception(refused.value, local=True) is JobError.ENGINE_REFUSED
    finally:
        await client.aclose()


async def test_an_engine_that_never_answers_times_out(
    raw_server: Callable[[Raw], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    answered = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answered.set()  # and then says nothing, holding the connection

    url = await raw_server(silent)
    monkeypatch.setattr(engine_http, "READ_TIMEOUT_S", 0.2)
    client = EngineHttp()
    try:
        with pytest.raises(TimeoutError):
            async with client.post(url, "/v1/x", b"{}", {}):
                pass
        assert answered.is_set()  # control: the request did reach it
    finally:
        await client.aclose()


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="line break"):
        EngineHttp().post("http://127.0.0.1:1", "/v1/x", b"", {"X-Id": "a\r\nX-Evil: 1"})
