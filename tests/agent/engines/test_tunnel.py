"""The engines' tunnel (`agent.engines.tunnel`, issue 32) between two `Tunnels` over a real
aiohttp server on 127.0.0.1 (the mTLS and the pin are the node API's, tested on real agents
in `test_span_e2e.py`): bytes go both ways unchanged and are counted at both ends; a caller
the worker side does not admit is refused (403) and the head's connection closed; a local
process that is not the head's engine is closed at once on the head's side; an engine that
is not up answers 502; more connections than the bound are closed at once, with a
control that is served; closing a part ends its listener and the connections through it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from agent.engines import tunnel
from agent.engines.tunnel import Tunnels
from netkit.guard import PEER_NODE_ID
from tests.fixtures.waiting import eventually

pytestmark = pytest.mark.asyncio


class Echo:
    """An "engine" on loopback: answers every chunk with itself upper-cased."""

    def __init__(self) -> None:
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            while data := await reader.read(65536):
                writer.write(data.upper())
                await writer.drain()
            writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()


@pytest_asyncio.fixture
async def ends() -> AsyncIterator[tuple[Tunnels, Tunnels, Echo, dict[str, Any]]]:
    engine = Echo()
    await engine.start()
    allowed: dict[str, Any] = {"caller": "nod_head", "port": engine.port}

    def admit(caller: str, replica: str) -> int | str:
        if replica != "rep_worker":
            return f"{replica} is no worker part here"
        if caller != allowed["caller"]:
            return "only the head's member"
        port: int = allowed["port"]
        return port

    worker_side = Tunnels(lambda member, replica: _never(), admit)

    @web.middleware
    async def as_caller(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        request[PEER_NODE_ID] = request.headers.get("X-Caller", "")
        return await handler(request)

    app = web.Application(middlewares=[as_caller])
    app.router.add_get("/v1/tunnel/{replica}", worker_side.serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    session = aiohttp.ClientSession()
    caller = {"id": "nod_head"}

    def dial(member: str, replica: str) -> AbstractAsyncContextManager[Any]:
        return session.ws_connect(
            f"http://127.0.0.1:{port}/v1/tunnel/{replica}",
            headers={"X-Caller": caller["id"]},
            max_msg_size=tunnel.MAX_MESSAGE,
        )

    # The head's engine is this test process: its own process group opens the connections.
    allowed["engine"] = os.getpgrp()
    head_side = Tunnels(
        dial, lambda caller, replica: "not a worker here", lambda head: allowed["engine"]
    )
    allowed["caller_ref"] = caller
    try:
        yield head_side, worker_side, engine, allowed
    finally:
        await head_side.aclose()
        await worker_side.aclose()
        await session.close()
        await runner.cleanup()
        await engine.aclose()


def _never() -> Any:
    raise AssertionError("the worker side dials nothing")


async def roundtrip(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await reader.readexactly(len(data))
    writer.close()
    return got


async def test_bytes_go_both_ways_unchanged_and_are_counted_at_both_ends(
    ends: tuple[Tunnels, Tunnels, Echo, dict[str, Any]],
) -> None:
    head, worker, _, _ = ends
    port = await head.open("rep_head", "nod_worker", "rep_worker")
    assert await head.open("rep_head", "nod_worker", "rep_worker") == port  # one listener
    payload = bytes(range(256)) * 4096  # 1 MiB, more than one message
    assert await roundtrip(port, payload) == payload.upper()
    await eventually(lambda: head.totals().get("rep_head") is not None, "the head counted")
    sent = head.totals()["rep_head"]
    assert (sent.sent, sent.received, sent.connections) == (len(payload), len(payload), 1)
    await eventually(
        lambda: worker.totals()["rep_worker"].received == len(payload), "the worker counted"
    )
    assert worker.totals()["rep_worker"].sent == len(payload)  # towards its engine


async def test_a_member_not_admitted_is_refused_and_its_connection_closed(
    ends: tuple[Tunnels, Tunnels, Echo, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    head, _, engine, allowed = ends
    allowed["caller_ref"]["id"] = "nod_stranger"
    port = await head.open("rep_head", "nod_worker", "rep_worker")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    assert await reader.read(64) == b""  # closed: nothing reached the engine
    writer.close()
    assert engine.connections == 0
    assert "403" in caplog.text
    # The control: admitted, the same bytes come back.
    allowed["caller_ref"]["id"] = "nod_head"
    assert await roundtrip(port, b"hello") == b"HELLO"


async def test_an_engine_not_up_answers_502_and_the_bound_closes_more_connections(
    ends: tuple[Tunnels, Tunnels, Echo, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    head, _, _engine, allowed = ends
    port = await head.open("rep_head", "nod_worker", "rep_worker")
    held = []
    for _ in range(tunnel.MAX_CONNECTIONS):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"X"
        held.append(writer)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await reader.read(64) == b""  # one more: closed at once
    writer.close()
    for w in held:
        w.close()
    await eventually(lambda: head.open_now("rep_head") == 0, "the closes reached the head")
    allowed["port"] = 1  # nothing listens there: the worker's side answers 502
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await reader.read(64) == b""
    writer.close()
    assert "502" in caplog.text
    assert "403" not in caplog.text


async def test_a_local_process_that_is_not_the_heads_engine_is_closed_at_once(
    ends: tuple[Tunnels, Tunnels, Echo, dict[str, Any]],
) -> None:
    head, _, engine, allowed = ends
    port = await head.open("rep_head", "nod_worker", "rep_worker")
    allowed["engine"] = 1  # the head's engine is another process group (init's)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    assert await reader.read(64) == b""  # closed before a byte went on
    writer.close()
    assert (head.refused, engine.connections) == (1, 0)
    allowed["engine"] = None  # no engine runs for it: nobody is let through either
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await reader.read(64) == b""
    writer.close()
    allowed["engine"] = os.getpgrp()  # the control: from the engine's group, served
    assert await roundtrip(port, b"hello") == b"HELLO"
    assert head.refused == 2


async def test_closing_a_part_ends_its_listener_and_its_connections(
    ends: tuple[Tunnels, Tunnels, Echo, dict[str, Any]],
) -> None:
    head, _, _, _ = ends
    port = await head.open("rep_head", "nod_worker", "rep_worker")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"a")
    assert await reader.readexactly(1) == b"A"
    await head.close("rep_head")
    assert await reader.read(64) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert head.totals() == {}
