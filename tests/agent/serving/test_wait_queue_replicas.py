"""A deployment's `maxInFlight` (issue 15, item 4) on real agents: a mock replica declared
with `nvpair deploy --max-in-flight 4` takes four requests at once; twelve sent together
through the member that does not run it wait their turn there, all complete, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, ready_everywhere, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAME = "limited"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("limited")
    async for started in engine_cluster(root, {"a": "l4:1", "b": None}):
        yield started


def max_overlap(jobs: list[dict[str, Any]]) -> int:
    """The most jobs running at one instant (an end before a start at the same ms)."""
    edges = sorted([(j["startedAt"], 1) for j in jobs] + [(j["completedAt"], -1) for j in jobs])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


async def test_a_replica_takes_max_in_flight_and_the_rest_wait_in_order(pair: list[Node]) -> None:
    a, b = pair  # b has no GPU: the replica of one GPU runs on a
    code, _, err = await a.cli(
        "deploy", NAME, "--model", "m", "--engine", "mock", "--max-in-flight", "4",
        "--", "--tokens-per-s", "20",
    )  # fmt: skip
    assert code == 0, err
    await eventually(lambda: ready_everywhere(pair, NAME, 1), "the replica ready", within_s=60)
    assert [r["nodeId"] for r in await replicas(b, NAME)] == [await a.node_id()]

    async def b_holds_the_limit() -> bool:
        # The replica's record and the deployment travel apart: b may see the replica ready
        # before the deployment (meanwhile it counts the replica as full, docs/deployments.md).
        declared = {d["name"]: d for d in await b.get("/v1/deployments")}
        return NAME in declared and declared[NAME]["maxInFlight"] == 4

    await eventually(b_holds_the_limit, "b holds the deployment's limit")

    url = f"http://127.0.0.1:{b.ports['facade']}/v1/chat/completions"
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}

    async def one(session: aiohttp.ClientSession) -> int:
        async with session.post(url, json=body) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        statuses = await asyncio.gather(*(one(session) for _ in range(12)))
    assert statuses == [200] * 12
    jobs = sorted(await b.get_settled_jobs(12), key=lambda j: int(j["id"]))
    assert [j["state"] for j in jobs] == ["completed"] * 12
    assert max_overlap(jobs) == 4  # never more than the limit at once, and it was used
    started = [j["startedAt"] for j in jobs]
    assert started == sorted(started), "a later request started before an earlier one"
