"""Member connections are pooled one per peer and direction and kept across quiet spells
(issue 18, item 4): an idle sender does not reconnect, and descriptors stay bounded."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from netkit.keepalive import client_keepalive_s, connector_options, server_keepalive_s
from tests.workload_manager.cluster_harness import Member, eventually, make_cluster

# The listener bound every nvpair server has. The inter-node server used to close a member's
# idle connection after it (30 s by default, and the client's aiohttp after 15 s), so every
# connection of a mesh was opened again, all at once, after each quiet spell.
IDLE_S = 0.5


def test_one_pooled_connection_per_peer_kept_past_aiohttps_default() -> None:
    options = connector_options({})
    assert options["limit_per_host"] == 1
    assert options["keepalive_timeout"] == client_keepalive_s({}) > 15.0  # aiohttp's own
    # The server keeps an idle member connection longer, so the client always closes it.
    assert server_keepalive_s({}) > client_keepalive_s({})
    assert server_keepalive_s({"NVPAIR_WM_KEEPALIVE_S": "5"}) >= 30.0  # never under idle_s
    assert connector_options({"NVPAIR_WM_KEEPALIVE_S": "5"})["keepalive_timeout"] == 5.0


def client_ends(port: int) -> set[int]:
    """Local ports of the established TCP connections to `port` on 127.0.0.1."""
    ends: set[int] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            ends.add(int(local.split(":")[1], 16))
    return ends


@pytest.fixture
async def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[Member]]:
    monkeypatch.setitem(os.environ, "NVPAIR_IDLE_TIMEOUT_S", str(IDLE_S))  # inherited
    members = make_cluster(tmp_path, ["a", "b"])
    for member in members:
        await member.start()
    a, b = members
    await a.set_peers([b])
    await b.set_peers([a])
    yield members
    for member in members:
        await member.stop()


async def test_an_idle_sender_keeps_its_one_connection(pair: list[Member]) -> None:
    a, b = pair
    for seq in (1, 2, 3):  # a few batches each way, then the connections are what they are
        await a.enter("w", seq)
        await b.enter("w", seq)
    await eventually(lambda: len(a.upserts()) >= 1 and len(b.upserts()) >= 1, "both told")
    await eventually(
        lambda: len(client_ends(b.port)) == 1 and len(client_ends(a.port)) == 1,
        "one connection each way",
    )
    a_to_b, b_to_a = client_ends(b.port), client_ends(a.port)
    # A quiet spell several times the listener's idle bound: the one thing under test is
    # that nothing happens in it, so it is waited out rather than waited for.
    await asyncio.sleep(4 * IDLE_S)
    await a.enter("w2", 1)
    await b.enter("w2", 1)
    await eventually(
        lambda: (
            any(r["id"] == "w2" for r in a.upserts()) and any(r["id"] == "w2" for r in b.upserts())
        ),
        "the events after the quiet spell told",
    )
    # The same connections carried them: no reconnect, no second connection.
    assert client_ends(b.port) == a_to_b
    assert client_ends(a.port) == b_to_a
    statuses = [await a.status(), await b.status()]
    assert all(p["retried"] == 0 for s in statuses for p in s["broadcast"])
