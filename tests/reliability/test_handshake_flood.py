"""A stranger's handshake flood (issue 25, item 1), against a real agent under an open-files
limit of 1,024: 1,100 connections to its node API, each with a completed TLS handshake and
the start of a join request whose headers never end, from one address and then from many.
While it lasts, a member's call over a new mTLS connection and the local API's `/healthz`
answer as they do without it.

The flood runs in its own process (`tests/fixtures/handshake_flood.py`), so what is
measured here is the agent's answer, not this process's event loop doing the stranger's
side of the handshakes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from certs import ClientContexts, ClusterDir, server_hostname_for
from tests.agent.harness import TIMEOUT, Node, make_node, start_cluster

FLOOD = 1100
OPEN_FILES = 1024
BAR_S = 1.0  # the bar: a member's call and /healthz answer within a second
ONE_SOURCE = ["127.0.0.1"]
MANY_SOURCES = [f"127.0.0.{i}" for i in range(2, 34)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("flood")
    nodes = [make_node(root, "a", None), make_node(root, "b", None)]
    nodes[0].open_files = OPEN_FILES
    for node in nodes:
        node.home.mkdir(parents=True)
    async for started in start_cluster(nodes):
        yield started


class Probe:
    """b calls a's node API over a new mTLS connection each time (the worst case: a member
    whose kept connection went), and a's local API answers `/healthz`; each call timed."""

    def __init__(self, a: Node, b: Node, a_id: str) -> None:
        self.a, self.a_id = a, a_id
        self.context = ClientContexts(ClusterDir(b.home / "cluster")).current()
        self.url = f"https://127.0.0.1:{a.ports['node']}/v1/members/ping"

    async def member_call(self) -> float:
        started = time.monotonic()
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.post(
                self.url,
                data=b"{}",
                headers={"Content-Type": "application/json"},
                ssl=self.context,
                server_hostname=server_hostname_for(self.a_id),
                timeout=aiohttp.ClientTimeout(total=TIMEOUT),
            ) as response,
        ):
            assert response.status == 200, await response.text()
        return time.monotonic() - started

    async def healthz(self) -> float:
        started = time.monotonic()
        async with asyncio.timeout(TIMEOUT):
            assert await self.a.healthy()
        return time.monotonic() - started

    async def worst(self, until: asyncio.Future[bytes] | None, rounds: int = 10) -> float:
        """The slowest call of either kind, calling every tenth of a second until `until`
        is done (at least `rounds` times when it is None)."""
        worst, done = 0.0, 0
        while (until is None and done < rounds) or (until is not None and not until.done()):
            worst = max(worst, await self.member_call(), await self.healthz())
            done += 1
            await asyncio.sleep(0.1)  # a pace, not a synchronisation: calls until `until`
        return worst


PING = (
    b"POST /v1/members/ping HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)
PARTIAL_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(16)


async def _ping_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One ping on a kept connection; the answer's status line."""
    writer.write(PING)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), TIMEOUT)
    return head.split(b"\r\n", 1)[0]


async def _flood_while_probing(a: Node, probe: Probe, sources: list[str]) -> tuple[str, float]:
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.fixtures.handshake_flood",
        str(a.ports["node"]), str(FLOOD), "16", *sources,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        cwd=os.getcwd(),
    )  # fmt: skip
    assert flood.stdin is not None
    assert flood.stdout is not None
    try:
        finished = asyncio.ensure_future(flood.stdout.readline())
        worst = await probe.worst(finished)
        line = (await asyncio.wait_for(finished, TIMEOUT)).decode()
        # ... and after every connection was tried, with what the stranger holds still held.
        worst = max(worst, await probe.worst(None, rounds=5))
        return line, worst
    finally:
        flood.stdin.close()
        await asyncio.wait_for(flood.wait(), TIMEOUT)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("sources", [ONE_SOURCE, MANY_SOURCES], ids=["one-source", "many"])
async def test_a_handshake_flood_stalls_neither_members_nor_the_local_api(
    pair: list[Node], sources: list[str]
) -> None:
    a, b = pair
    probe = Probe(a, b, await a.node_id())
    control = await probe.worst(None)  # the same calls, no flood
    line, worst = await _flood_while_probing(a, probe, sources)
    assert line.startswith("flooded"), line
    print(f"{line.strip()}: worst call {worst:.3f} s under the flood, {control:.3f} s without")
    assert worst < max(BAR_S, 5 * control), (line, worst, control)
    assert await a.healthy()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_members_kept_connection_outlives_strangers_at_its_address(
    pair: list[Node],
) -> None:
    a, b = pair
    a_id = await a.node_id()
    context = ClientContexts(ClusterDir(b.home / "cluster")).current()
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", a.ports["node"], ssl=context, server_hostname=server_hostname_for(a_id)
    )
    strangers: list[asyncio.StreamWriter] = []
    readers: list[asyncio.StreamReader] = []
    try:
        assert await _ping_on(reader, writer) == b"HTTP/1.1 200 OK"  # the control
        # Strangers at the member's address (127.0.0.1), past its per-source cap (128):
        # each newcomer over it closes the oldest idle stranger, never the member's.
        for _ in range(3):
            opened = await asyncio.gather(
                *(asyncio.open_connection("127.0.0.1", a.ports["node"]) for _ in range(100))
            )
            for stranger_reader, stranger in opened:
                stranger.write(PARTIAL_HELLO)
                strangers.append(stranger)
                readers.append(stranger_reader)
        # The server has taken them: the first strangers were closed to make room.
        with contextlib.suppress(ConnectionResetError):
            await asyncio.wait_for(readers[0].read(), TIMEOUT)
        assert await _ping_on(reader, writer) == b"HTTP/1.1 200 OK"
    finally:
        writer.close()
        for stranger in strangers:
            stranger.transport.abort()
