"""Anti-entropy between real agents: a divergence made behind the agents' backs -- rows
deleted from one member's Jobs database, a newer state only one member holds -- is
repaired without any reconnect."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from tests.agent.harness import Node, make_node, start_cluster
from tests.fixtures.records import lifecycle_event, workload_record
from tests.fixtures.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("anti-entropy")
    nodes = [make_node(root, "a", "l4:1"), make_node(root, "b", "l4:1")]
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nanti_entropy_s = 0.5\n")
    async for started in start_cluster(nodes):
        yield started


async def states(node: Node, prefix: str) -> dict[str, str]:
    return {j["id"]: j["state"] for j in await node.get("/v1/jobs") if j["id"].startswith(prefix)}


async def post_event(node: Node, record: dict[str, object]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            node.api + "/v1/jobs/events", json=lifecycle_event(record), headers=node.owner
        ) as response,
    ):
        assert response.status == 202, await response.text()


async def test_rows_deleted_behind_an_agents_back_come_back(pair: list[Node]) -> None:
    a, b = pair
    origin = await a.node_id()
    now = int(time.time() * 1000)
    for n in range(20):
        await post_event(a, workload_record(f"lost-{n}", 1 + n % 3, origin=origin, created_at=now))
    want = {f"lost-{n}": ("queued", "running", "completed")[n % 3] for n in range(20)}
    await eventually(lambda: _equal(b, "lost-", want), "b holds a's 20 jobs")
    restarts = (await b.get("/healthz"))["manager"]["restarts"]
    with sqlite3.connect(b.home / "jobs.db", timeout=5) as raw:
        raw.execute("DELETE FROM jobs WHERE id IN ('lost-3', 'lost-4', 'lost-5')")
    assert len(await states(b, "lost-")) == 17  # the control: b really lost them
    await eventually(
        lambda: _equal(b, "lost-", want), "anti-entropy restores b's rows", within_s=30
    )
    # Without a reconnect: nobody restarted, and the workload manager did not relay again.
    assert (await b.get("/healthz"))["manager"]["restarts"] == restarts


async def test_a_state_only_one_member_holds_reaches_the_other(pair: list[Node]) -> None:
    a, b = pair
    origin = await a.node_id()
    now = int(time.time() * 1000)
    await post_event(a, workload_record("newer-1", 1, origin=origin, created_at=now))
    await eventually(lambda: _equal(b, "newer-", {"newer-1": "queued"}), "b sees it queued")
    told = await relay_counters(b)
    # a's own store moves on behind its manager's back: no event is relayed for it.
    completed = workload_record("newer-1", 3, origin=origin, created_at=now)
    with sqlite3.connect(a.home / "jobs.db", timeout=5) as raw:
        raw.execute(
            "UPDATE jobs SET seq = 3, state = 'completed', record = ? WHERE id = 'newer-1'",
            (_encode(completed),),
        )
    await eventually(
        lambda: _equal(b, "newer-", {"newer-1": "completed"}), "b learns it completed", within_s=30
    )
    # b's workload manager is handed the repaired record too, so its relay knows it (and
    # passes it on): a later delivery of it is a duplicate, not a new record for b's store.
    # (The control: that queued record reached b through the relay, not as a local event.)
    await eventually(
        lambda: _told_more(b, told), "b's manager is told of the repaired record", within_s=10
    )
    assert (await relay_counters(b))["received_remote"] == told["received_remote"]


async def relay_counters(node: Node) -> dict[str, int]:
    status = await node.get("/v1/manager")
    return dict(status["status"]["counters"])


async def _told_more(node: Node, before: dict[str, int]) -> bool:
    now = await relay_counters(node)
    return now["received_local"] > before["received_local"] and now["accepted"] > before["accepted"]


async def _equal(node: Node, prefix: str, want: dict[str, str]) -> bool:
    return await states(node, prefix) == want


def _encode(record: dict[str, object]) -> bytes:
    return msgspec.json.encode(record)
