"""The fault proxy's controls on real sockets, against an echo server: what a scenario
relies on when it drops, delays, resets or heals a link."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from tests.fixtures.waiting import eventually

from .cluster import SEED_ENV, fault_rng, manager_pid
from .proxy import FaultProxy

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connect = Callable[[], Awaitable[Conn]]


@pytest_asyncio.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(4096):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    async with server, FaultProxy("->echo", target, random.Random(7)) as fault_proxy:
        yield fault_proxy


@pytest_asyncio.fixture
async def connect(proxy: FaultProxy) -> AsyncIterator[Callable[[], Awaitable[Conn]]]:
    """Opens a connection through the proxy; each is closed after the test."""
    opened: list[asyncio.StreamWriter] = []

    async def open_one() -> Conn:
        conn = await asyncio.open_connection("127.0.0.1", proxy.port)
        opened.append(conn[1])
        return conn

    yield open_one
    for writer in opened:
        writer.close()


async def round_trip(conn: Conn, data: bytes) -> bytes:
    reader, writer = conn
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 5)


async def closed(conn: Conn) -> bool:
    # EOF or a reset: the proxy closed this connection.
    try:
        return await asyncio.wait_for(conn[0].read(1), 5) == b""
    except ConnectionError:
        return True


async def test_bytes_pass_both_ways(proxy: FaultProxy, connect: Connect) -> None:
    conn = await connect()
    assert await round_trip(conn, b"hello" * 1000) == b"hello" * 1000
    assert proxy.counters.accepted == 1
    assert proxy.counters.bytes_forwarded == 2 * 5000


async def test_drop_refuses_new_connections_and_discards_on_open_ones(
    proxy: FaultProxy, connect: Connect
) -> None:
    kept = await connect()
    assert await round_trip(kept, b"before") == b"before"
    proxy.drop()
    assert await closed(await connect())
    assert proxy.counters.refused == 1
    kept[1].write(b"lost")
    await kept[1].drain()
    await eventually(lambda: proxy.counters.bytes_discarded == 4, "the dropped bytes are read")
    proxy.heal()
    # Only what was sent after the heal comes back: the dropped bytes never arrived.
    assert await round_trip(kept, b"after") == b"after"
    assert await round_trip(await connect(), b"new") == b"new"


async def test_reset_cuts_every_open_connection(proxy: FaultProxy, connect: Connect) -> None:
    conns = [await connect() for _ in range(3)]
    for conn in conns:
        assert await round_trip(conn, b"x") == b"x"
    proxy.reset()
    for conn in conns:
        assert await closed(conn)
    assert proxy.counters.resets == 6  # both sides of each
    assert await round_trip(await connect(), b"still serves") == b"still serves"


async def test_delay_holds_bytes_back_in_order(proxy: FaultProxy, connect: Connect) -> None:
    conn = await connect()
    proxy.delay(150, jitter_ms=50)
    start = time.monotonic()
    conn[1].write(b"".join(b"%03d" % n for n in range(100)))
    got = await asyncio.wait_for(conn[0].readexactly(300), 5)
    # Each way is held at least 100 ms (150 less the most jitter).
    assert time.monotonic() - start >= 0.2
    assert got == b"".join(b"%03d" % n for n in range(100))
    proxy.heal()
    start = time.monotonic()
    assert await round_trip(conn, b"fast") == b"fast"
    assert time.monotonic() - start < 0.2
    with pytest.raises(ValueError, match="jitter_ms"):
        proxy.delay(10, jitter_ms=20)


async def test_lose_delays_chunks_like_retransmissions_and_keeps_every_byte(
    proxy: FaultProxy, connect: Connect
) -> None:
    conn = await connect()
    proxy.lose(0.5, retransmit_ms=5)
    # Each round trip is its own chunk each way: some are "lost", all arrive, in order.
    for n in range(40):
        assert await round_trip(conn, b"%03d" % n) == b"%03d" % n
    lost = proxy.counters.chunks_lost
    assert lost > 0
    proxy.heal()
    for n in range(40):
        assert await round_trip(conn, b"%03d" % n) == b"%03d" % n
    assert proxy.counters.chunks_lost == lost  # the control: healed, nothing more is lost
    with pytest.raises(ValueError, match="fraction"):
        proxy.lose(1.0)


async def test_drop_from_cuts_one_caller_and_lets_the_others_through(proxy: FaultProxy) -> None:
    opened: list[asyncio.StreamWriter] = []

    async def from_(source: str) -> Conn:
        conn = await asyncio.open_connection("127.0.0.1", proxy.port, local_addr=(source, 0))
        opened.append(conn[1])
        return conn

    cut, kept = await from_("127.0.0.2"), await from_("127.0.0.3")
    for conn in (cut, kept):
        assert await round_trip(conn, b"x") == b"x"
    proxy.drop_from("127.0.0.2")
    assert await closed(cut)
    assert await closed(await from_("127.0.0.2"))
    # The control: another caller's open and new connections still pass.
    assert await round_trip(kept, b"still") == b"still"
    assert await round_trip(await from_("127.0.0.3"), b"new") == b"new"
    proxy.heal_from("127.0.0.2")
    assert await round_trip(await from_("127.0.0.2"), b"back") == b"back"
    for writer in opened:
        writer.close()


def test_the_seed_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_ENV, "424242")
    assert fault_rng(1).random() == random.Random(424242).random()
    monkeypatch.delenv(SEED_ENV)
    assert fault_rng(1).random() == random.Random(1).random()
    monkeypatch.setenv(SEED_ENV, "soon")
    with pytest.raises(ValueError, match=SEED_ENV):
        fault_rng(1)


async def test_manager_pid_finds_a_child_by_its_command_line() -> None:
    # A stand-in child whose command line names workload_manager, as the agent's does.
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; sys.stdin.read()", "workload_manager",
        stdin=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert manager_pid(os.getpid()) == child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        await child.wait()
    assert manager_pid(os.getpid()) is None
