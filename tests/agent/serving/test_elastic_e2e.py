"""Elastic deployments on real agents (issue 30): three members, mock engines that need no
GPU. A deployment at zero is listed in `/v1/models`; twenty requests sent together through
the `openai` client to a member that runs nothing wait while one replica starts -- one
scale-up, not twenty -- and all answer; `nvpair explain --deployment` shows the load seen.
A burst that waits raises a deployment to its max and never past it; quiet brings it back
to its min, and idle to zero."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, post, ready_everywhere
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("elastic")
    async for started in engine_cluster(root, {"a": None, "b": None, "c": None}):
        yield started


async def declared(node: Node, name: str) -> dict[str, Any]:
    (found,) = [d for d in await node.get("/v1/deployments") if d["name"] == name]
    return dict(found)


async def test_twenty_requests_at_zero_start_one_replica_and_all_answer(trio: list[Node]) -> None:
    a, _, c = trio
    body = {"name": "cold", "engine": "mock", "source": "cold", "gpus": 0}
    bounds = {"minReplicas": 0, "maxReplicas": 3, "idleToZeroS": 600, "scaleDownAfterS": 600}
    status, text = await post(a, "/v1/deployments", body | bounds)
    assert status == 201, text
    made = json.loads(text)
    assert made["replicas"] == 0
    version = made["version"]
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{c.ports['facade']}/v1", api_key="none", max_retries=0
    )
    try:

        async def listed() -> bool:
            return "cold" in {m.id async for m in client.models.list()}

        await eventually(listed, "c lists cold at zero")

        async def ask() -> str:
            answer = await client.chat.completions.create(
                model="cold", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            return answer.model

        answers = await asyncio.gather(*(ask() for _ in range(20)))
    finally:
        await client.close()
    assert answers == ["cold"] * 20  # each a 200: none a 404 or 503

    async def holds_the_scale_up() -> bool:  # the decider's version reaches c in a push
        return int((await declared(c, "cold"))["replicas"]) > 0

    await eventually(holds_the_scale_up, "c holds the scale-up")
    after = await declared(c, "cold")
    assert after["replicas"] == 1
    assert after["version"] == version + 1  # one scale-up for the whole burst
    assert after["elastic"]["reason"] == "waiting"
    jobs = await c.get_settled_jobs(20)
    assert [j["state"] for j in jobs] == ["completed"] * 20

    async def sees_it_ready() -> bool:  # what c sees (its next sample after the record)
        scaling = (await c.get("/v1/deployments/cold/explain"))["scaling"]
        return bool(scaling["load"]["ready"] == 1)

    await eventually(sees_it_ready, "c's samples see the replica ready")
    scaling = (await c.get("/v1/deployments/cold/explain"))["scaling"]
    assert scaling["decider"] in {await n.node_id() for n in trio}  # and who decides
    code, out, err = await c.cli("explain", "--deployment", "cold")
    assert code == 0, err
    assert "scales on load: 1 ready" in out
    # Counted: the twenty waited for the cold start at c; the decider scaled up once and
    # timed it until the replica was ready.
    assert await c.metric("nvpair_cold_start_wait_seconds_count") == 20
    (decider,) = [n for n in trio if await n.node_id() == scaling["decider"]]
    changes = await decider.metric("nvpair_scale_changes_total", deployment="cold")
    assert changes == 1

    async def timed() -> bool:  # once its own samples see the replica ready
        return await decider.metric("nvpair_cold_start_seconds_count") == 1

    await eventually(timed, "the decider timed the cold start")
    code, _, err = await a.cli("undeploy", "cold")
    assert code == 0, err


async def test_a_burst_reaches_max_and_no_further_then_quiet_returns_to_min_and_zero(
    trio: list[Node],
) -> None:
    a, b, _ = trio
    body = {
        "name": "bursty", "engine": "mock", "source": "bursty", "gpus": 0, "maxInFlight": 1,
        "args": ["--latency-ms", "300"], "minReplicas": 1, "maxReplicas": 2,
        "scaleDownAfterS": 2, "idleToZeroS": 600,
    }  # fmt: skip
    status, made = await post(a, "/v1/deployments", body)
    assert status == 201, made
    await eventually(lambda: ready_everywhere(trio, "bursty", 1), "one replica", within_s=60)
    seen: list[int] = []

    async def burst() -> list[int]:
        url = f"http://127.0.0.1:{b.ports['facade']}/v1/chat/completions"
        ask = {"model": "bursty", "messages": [{"role": "user", "content": "hi"}]}

        async def one(session: aiohttp.ClientSession) -> int:
            async with session.post(url, json=ask) as response:
                await response.read()
                return response.status

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return list(await asyncio.gather(*(one(session) for _ in range(30))))

    async def at_max() -> bool:
        seen.append((await declared(b, "bursty"))["replicas"])
        return await ready_everywhere(trio, "bursty", 2)

    statuses = await burst()
    assert statuses == [200] * 30
    await eventually(at_max, "a second replica for the burst", within_s=60)
    assert max(seen) == 2  # never past max
    statuses = await burst()  # two replicas take it; nothing more is asked for
    assert statuses == [200] * 30
    assert (await declared(b, "bursty"))["replicas"] == 2

    async def back_to_min() -> bool:
        shown = await declared(a, "bursty")
        return bool(shown["replicas"] == 1 and shown["elastic"]["reason"] == "quiet")

    await eventually(back_to_min, "quiet brings it back to its min", within_s=60)
    # To zero once idle: the same deployment with min 0 and a short idle period.
    status, made = await post(a, "/v1/deployments", body | {"minReplicas": 0, "idleToZeroS": 3})
    assert status == 201, made

    async def at_zero() -> bool:
        shown = await declared(b, "bursty")
        return bool(shown["replicas"] == 0 and shown["elastic"]["reason"] == "idle")

    await eventually(at_zero, "idle takes it to zero", within_s=60)
    await eventually(lambda: ready_everywhere(trio, "bursty", 0), "its replica gone")
    code, _, err = await a.cli("undeploy", "bursty")
    assert code == 0, err
