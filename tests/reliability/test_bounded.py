"""Bounded servers (issue 12, item 5), against real agents: 1,000 half-open connections on
the facade (a partial request line; and 100 with a partial body) and 1,000 on the node API
(a partial TLS ClientHello), from eight source addresses, starve nothing -- a peer's record
still updates, the local API still answers -- and the server closes them once the read
timeouts (small here, set through the environment) pass.

The agent under attack runs with an open-files limit of 1,024 (a common default): without
caps that fit it, 2,000 held connections exhaust its descriptors and the kernel refuses
every `accept()` -- the peer's pushes and the local API with the stranger's."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.apis.node import JOIN_BURST
from agent.serving.facade import facade_address
from netkit.sites import PerSourceRate
from tests.agent.harness import TIMEOUT, Node, eventually, make_node, start_cluster

HELD = 1000
OPEN_FILES = 1024
HOLD_S = 10  # the idle and handshake timeouts: how long a half-open connection is held
SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]  # the stranger's addresses
PARTIAL_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"
# Whole headers, then a tenth of the body they announce.
SLOW_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model":'
)
# A TLS record header announcing a 512-byte handshake message, and its first bytes only.
PARTIAL_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(16)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("bounded")
    nodes = [make_node(root, "a", None), make_node(root, "b", None)]
    nodes[0].open_files = OPEN_FILES
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 0.5\n")
    with pytest.MonkeyPatch.context() as env:  # the agents inherit the test's environment
        # Long enough that what is asserted while the connections are held happens while
        # they are; short enough that the test sees them closed.
        env.setitem(os.environ, "NVPAIR_IDLE_TIMEOUT_S", str(HOLD_S))
        env.setitem(os.environ, "NVPAIR_TLS_HANDSHAKE_TIMEOUT_S", str(HOLD_S))
        env.setitem(os.environ, "NVPAIR_BODY_TIMEOUT_S", "3")
        async for started in start_cluster(nodes):
            yield started


async def _hold(
    port: int, first_bytes: bytes, writers: list[asyncio.StreamWriter], count: int = HELD
) -> list[asyncio.StreamReader]:
    readers = []
    for batch in range(count // 100):  # in batches: a burst of 1,000 SYNs overflows the backlog
        pairs = await asyncio.gather(
            *(
                asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(SOURCES[(batch + i) % len(SOURCES)], 0)
                )
                for i in range(100)
            )
        )
        for reader, writer in pairs:
            writer.write(first_bytes)
            readers.append(reader)
            writers.append(writer)
    return readers


async def _closed_by_server(reader: asyncio.StreamReader) -> None:
    # The server's close (or abort) ends the read; a connection still held times it out.
    with contextlib.suppress(ConnectionResetError):
        await asyncio.wait_for(reader.read(), TIMEOUT)


async def _generation_of(seer: Node, node_id: str) -> Any:
    for node in await seer.get("/v1/nodes"):
        if node["nodeId"] == node_id:
            return node["generation"]
    return None


@pytest.mark.asyncio(loop_scope="module")
async def test_half_open_connections_starve_nothing_and_are_closed(pair: list[Node]) -> None:
    a, b = pair
    b_id = await b.node_id()

    async def a_has_b() -> bool:
        return await _generation_of(a, b_id) is not None

    await eventually(a_has_b, "a has b's record")  # the control
    before = await _generation_of(a, b_id)
    writers: list[asyncio.StreamWriter] = []
    try:
        await _held_and_closed(a, b, b_id, before, writers)
    finally:
        for writer in writers:
            writer.close()


async def _held_and_closed(
    a: Node, b: Node, b_id: str, before: int, writers: list[asyncio.StreamWriter]
) -> None:
    # The node API's first: a listener that refuses handshakes accepts slowly, and on a busy
    # machine a batch may wait out SYN retransmits (seconds) -- time that must not come out of
    # the facade's connections' hold before the push is seen.
    on_node = await _hold(a.ports["node"], PARTIAL_HELLO, writers)
    held = await _hold(a.ports["facade"], SLOW_BODY, writers, count=100)  # busy: not evicted
    held += await _hold(a.ports["facade"], PARTIAL_REQUEST, writers)

    # While they are held: b's record still reaches a (a push over mTLS to a's node API,
    # from the same address as the stranger), and a's local API answers. A record is pushed
    # when it changes: b cordons itself.
    code, _, err = await b.cli("node", "cordon", b_id)
    assert code == 0, err

    async def b_pushed() -> bool:
        return bool((await _generation_of(a, b_id) or 0) > before)

    await eventually(b_pushed, "b's record updates on a while 2,000 connections are held")
    assert await a.healthy()
    # ... and they were held then: the newest on the facade (which no later one evicted) are
    # still open, and so are some on the node API (whose handshakes from an address no
    # member connected from are rationed: most were refused at once). Without caps that fit
    # the open-files limit, the push and the local API wait until the timeouts close them.
    newest = held[HELD - 50 + 100 :]
    assert not [r for r in newest if r.at_eof()], "the push came only once they were closed"
    assert [r for r in on_node if not r.at_eof() and r.exception() is None]

    # After the read timeout the server has closed every one of them.
    await asyncio.gather(*(_closed_by_server(r) for r in held + on_node))
    assert await a.healthy()  # and a is still well


def test_facade_binds_loopback_unless_opened() -> None:
    assert facade_address(None, None, False)[0] == "127.0.0.1"
    assert facade_address(None, None, True)[0] is None  # API keys: every interface
    assert facade_address("10.0.0.5", None, False)[0] == "10.0.0.5"
    assert facade_address(None, "10.0.0.6", False)[0] == "10.0.0.6"


def test_join_rate_per_source() -> None:
    rate = PerSourceRate(per_s=0.1, burst=3)
    assert [rate.allow("1.2.3.4", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert rate.allow("5.6.7.8", now=0.0)  # another source has its own bucket
    assert not rate.allow("1.2.3.4", now=5.0)
    assert rate.allow("1.2.3.4", now=10.0)  # refilled: one each 10 s


@pytest.mark.asyncio(loop_scope="module")
async def test_join_is_rate_limited_per_source_and_logged_at_a_bounded_rate(
    pair: list[Node],
) -> None:
    a = pair[0]
    url = f"https://127.0.0.1:{a.ports['node']}/v1/join"
    statuses = []
    async with aiohttp.ClientSession() as session:  # a stranger: no client certificate
        for _ in range(JOIN_BURST + 10):
            async with session.post(url, json={"not": "a join"}, ssl=False) as response:
                statuses.append(response.status)
    # The control: the first tries reach the route (400, not a join); the rest are 429.
    assert statuses[0] == 400
    assert statuses[-10:] == [429] * 10
    assert 429 not in statuses[: JOIN_BURST - 5]  # a few may have been spent by the joins
    await eventually(lambda: a.log_count("refused a join from") >= 1, "the refusal is logged")
    assert a.log_count("refused a join from") <= 2  # ten refusals, one line (or two)
