"""A node's own jobs are its own: a real member (b, with its own certificate) sends a's
manager and a's node API records and removals claiming to originate from a -- they are
dropped and counted, and a's Jobs list and jobs.db do not change; the same events with b's
own origin are taken (the control). A seq past the bound is refused."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from agent.cluster.node_client import NodeClient
from broker.anti_entropy import Exchange
from certs import ClientContexts, ClusterDir, server_hostname_for
from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.fixtures.records import node_record, workload_record
from workload_manager.workload import Workload, WorkloadRemoval

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("own-jobs")
    async for started in start_cluster(
        [make_node(root, "a", "l4:1"), make_node(root, "b", "l4:1")]
    ):
        yield started


def record(wid: str, origin: str, **extra: Any) -> dict[str, Any]:
    return workload_record(
        wid, 1, origin=origin, run="run-x", created_at=int(time.time() * 1000), **extra
    )


async def as_b_to_a_manager(a: Node, b: Node, a_id: str, params: dict[str, Any]) -> int:
    """POST one `workload:submitted` to a's workload manager with b's certificate."""
    frame = {"jsonrpc": "2.0", "method": "workload:submitted", "params": {"workloadInfo": params}}
    context = ClientContexts(ClusterDir(b.home / "cluster")).current()
    url = f"https://127.0.0.1:{a.ports['manager']}/v1/workloads/events"
    async with aiohttp.ClientSession() as session, session.post(
        url, data=msgspec.json.encode(frame), headers={"Content-Type": "application/json"},
        ssl=context, server_hostname=server_hostname_for(a_id),
    ) as response:  # fmt: skip
        await response.read()
        return response.status


async def counters(node: Node) -> dict[str, int]:
    return dict((await node.get("/v1/manager"))["status"]["counters"])


async def ids(node: Node) -> set[str]:
    return {job["id"] for job in await node.jobs()}


def stored(node: Node, text: str) -> bool:
    return any(
        text.encode() in p.read_bytes() for p in node.home.iterdir() if p.name.startswith("jobs.db")
    )


async def test_a_peers_event_as_the_receivers_own_is_dropped(pair: list[Node]) -> None:
    a, b = pair
    a_id, b_id = await a.node_id(), await b.node_id()
    before = await counters(a)
    assert await as_b_to_a_manager(a, b, a_id, record("forged-relay", a_id)) == 202
    # Past the bound: refused outright (400), whoever's it claims to be.
    huge = {**record("huge-seq", b_id), "seq": 2**53}  # MAX_SEQ + 1
    assert await as_b_to_a_manager(a, b, a_id, huge) == 400
    # The control: the same event with the sender's own origin is taken.
    assert await as_b_to_a_manager(a, b, a_id, record("taken-relay", b_id)) == 202
    await eventually(lambda: _lists(a, "taken-relay"), "a takes b's own event")
    assert not {"forged-relay", "huge-seq"} & await ids(a)
    assert not stored(a, "forged-relay")
    assert not stored(a, "huge-seq")
    after = await counters(a)
    assert after["own_origin"] == before["own_origin"] + 1
    assert after["accepted"] == before["accepted"] + 1


async def test_anti_entropy_from_a_peer_cannot_write_the_receivers_jobs(pair: list[Node]) -> None:
    a, b = pair
    a_id, b_id = await a.node_id(), await b.node_id()
    await a.enter("mine-ae", 1, a_id)  # a's own job, which b will try to remove
    await eventually(lambda: _lists(a, "mine-ae"), "a lists its own job")
    refused = await a.metric("nvpair_anti_entropy_own_origin_total")
    a_record = node_record(a_id, node_port=a.ports["node"])
    client = NodeClient(ClusterDir(b.home / "cluster"), lambda n: a_record if n == a_id else None)
    decode = msgspec.json.Decoder(Workload).decode
    exchange = Exchange(
        records=[
            decode(msgspec.json.encode(record("forged-ae", a_id))),
            decode(msgspec.json.encode(record("taken-ae", b_id))),  # the control
        ],
        removals=[WorkloadRemoval(workloadId="mine-ae", originatedFrom=a_id)],
    )
    try:
        await client.repair_exchange(a_id, exchange)
    finally:
        await client.aclose()
    await eventually(lambda: _lists(a, "taken-ae"), "a takes b's own record")
    listed = await ids(a)
    assert "mine-ae" in listed
    assert "forged-ae" not in listed
    assert not stored(a, "forged-ae")
    assert await a.metric("nvpair_anti_entropy_own_origin_total") == refused + 2


async def _lists(node: Node, wid: str) -> bool:
    return wid in await ids(node)
