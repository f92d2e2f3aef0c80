"""Elastic deployments on real agents (issue 30): three members, mock engines that need no
GPU. A deployment at zero is listed in `/v1/models`; twenty requests sent together through
the `openai` client to a member that runs nothing wait while one replica starts -- one
scale-up, not twenty -- and all answer; `nvpair explain --deployment` shows the load seen.
A burst that waits raises a deployment to its max and never past it; quiet brings it back
to its min, and idle to zero. Two deployments competing for the cluster's two GPUs follow
the written rule: one at zero with a request waiting takes a GPU from one above its min,
never below that min."""

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
    # Two GPUs in the cluster: what the competing deployments share (the others need none).
    async for started in engine_cluster(root, {"a": "l4:1", "b": "l4:1", "c": None}):
        yield started


async def declared(node: Node, name: str) -> dict[str, Any]:
    (found,) = [d for d in await node.get("/v1/deployments") if d["name"] == name]
    return dict(found)


async def lists(node: Node, model: str) -> bool:
    """Whether `node`'s facade lists `model` in `/v1/models` (a deployment at zero too)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{node.ports['facade']}/v1/models") as response,
    ):
        return model in {m["id"] for m in (await response.json())["data"]}


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

    async def told_everywhere() -> bool:  # every member saw the change and timed the start
        for node in trio:
            kinds = [e["kind"] for e in await node.get("/v1/deployments/events?deployment=cold")]
            if kinds != ["cold-start", "scale-up"]:  # the newest first
                return False
        return True

    await eventually(told_everywhere, "every member tells the scale-up and the cold start")
    code, out, err = await a.cli("explain", "--deployment", "cold")
    assert code == 0, err
    assert "scale-up 0 -> 1 (waiting)" in out
    assert "cold start: a replica ready in" in out
    code, _, err = await a.cli("undeploy", "cold")
    assert code == 0, err


async def test_a_burst_reaches_max_and_no_further_then_quiet_returns_to_min_and_zero(
    trio: list[Node],
) -> None:
    a, b, _ = trio
    # A burst lasts 12 s on one replica (30 requests of 400 ms, one at a time), time for the
    # decider's 3 s of waiting samples on a slow machine. The second replica is then kept
    # at least 15 s after it was asked for: with a quiet period of 2 s, a burst that ended
    # while it started could have it asked away before every member saw it ready.
    body = {
        "name": "bursty", "engine": "mock", "source": "bursty", "gpus": 0, "maxInFlight": 1,
        "args": ["--latency-ms", "400"], "minReplicas": 1, "maxReplicas": 2,
        "scaleDownAfterS": 15, "idleToZeroS": 600,
    }  # fmt: skip
    status, made = await post(a, "/v1/deployments", body)
    assert status == 201, made
    await eventually(lambda: ready_everywhere(trio, "bursty", 1), "one replica", within_s=60)

    async def limited_everywhere() -> bool:
        # A member sees a replica in its holder's record before it may hold the deployment,
        # and until then knows no `maxInFlight` for it: a burst sent then runs all at once,
        # nothing waits, and nothing is scaled (seen in one run of three).
        for node in trio:
            held = [d for d in await node.get("/v1/deployments") if d["name"] == "bursty"]
            if not held or held[0]["maxInFlight"] != 1:
                return False
        return True

    await eventually(limited_everywhere, "every member holds the deployment and its limit")
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
    quick = {"minReplicas": 0, "idleToZeroS": 3, "scaleDownAfterS": 2}
    status, made = await post(a, "/v1/deployments", body | quick)
    assert status == 201, made

    async def at_zero() -> bool:
        shown = await declared(b, "bursty")
        return bool(shown["replicas"] == 0 and shown["elastic"]["reason"] == "idle")

    await eventually(at_zero, "idle takes it to zero", within_s=60)
    await eventually(lambda: ready_everywhere(trio, "bursty", 0), "its replica gone")
    code, _, err = await a.cli("undeploy", "bursty")
    assert code == 0, err


async def test_a_cold_deployment_takes_a_gpu_from_one_above_its_min_and_no_further(
    trio: list[Node],
) -> None:
    a, b, c = trio
    quiet = {"scaleDownAfterS": 600, "idleToZeroS": 600}  # only the rule moves counts here
    steady = {"name": "steady", "engine": "mock", "source": "steady", "gpus": 1}
    status, made = await post(
        a, "/v1/deployments", steady | quiet | {"minReplicas": 1, "maxReplicas": 2}
    )
    assert status == 201, made
    status, made = await post(a, "/v1/deployments/steady/scale", {"replicas": 2})
    assert status == 200, made
    await eventually(
        lambda: ready_everywhere(trio, "steady", 2), "steady on both GPUs", within_s=60
    )
    # Its min is 1, so it is counted at once -- with no GPU free, a replica counted but not
    # placed -- and once it has a GPU it is at its min: no donor to the third one below.
    cold = {"name": "wanted", "engine": "mock", "source": "wanted", "gpus": 1}
    status, made = await post(
        a, "/v1/deployments", cold | quiet | {"minReplicas": 1, "maxReplicas": 2}
    )
    assert status == 201, made
    await eventually(lambda: lists(c, "wanted"), "c lists wanted, not running")
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{c.ports['facade']}/v1", api_key="none", max_retries=0
    )
    try:  # no GPU is free: the request waits while steady, above its min, yields one
        answer = await client.chat.completions.create(
            model="wanted", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    finally:
        await client.close()
    assert answer.model == "wanted"

    async def shared() -> bool:
        held = {d: await declared(b, d) for d in ("steady", "wanted")}
        return bool(held["steady"]["replicas"] == 1 and held["wanted"]["replicas"] == 1)

    await eventually(shared, "one GPU each")
    assert (await declared(b, "steady"))["elastic"]["reason"] == "yielded"
    await eventually(lambda: ready_everywhere(trio, "steady", 1), "steady down to its min")
    await eventually(lambda: ready_everywhere(trio, "wanted", 1), "wanted up")
    # The control of "no further": a second cold deployment finds steady at its min and no
    # GPU free -- it stays at zero (no room) and takes nothing from either.
    third = {"name": "later", "engine": "mock", "source": "later", "gpus": 1}
    status, made = await post(
        a, "/v1/deployments", third | quiet | {"minReplicas": 0, "maxReplicas": 1}
    )
    assert status == 201, made
    await eventually(lambda: lists(c, "later"), "c lists later at zero")
    url = f"http://127.0.0.1:{c.ports['facade']}/v1/chat/completions"
    ask = {"model": "later", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        waiting = asyncio.create_task(session.post(url, json=ask))
        try:

            async def no_room() -> bool:  # the decider's last word on it (no new version:
                # the count stays what it was), once every member holds it: b is read next,
                # and a decider found first (a) once answered before b had it
                for node in trio:
                    if not any(d["name"] == "later" for d in await node.get("/v1/deployments")):
                        return False  # not here yet
                for node in trio:
                    scaling = (await node.get("/v1/deployments/later/explain")).get("scaling")
                    if scaling and scaling["decidesHere"] and scaling["lastDecision"]:
                        return bool(scaling["lastDecision"]["reason"] == "no room")
                return False

            await eventually(no_room, "later is told there is no room")
            counts = {d: (await declared(b, d))["replicas"] for d in ("steady", "wanted", "later")}
            assert counts == {"steady": 1, "wanted": 1, "later": 0}
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
    for name in ("steady", "wanted", "later"):
        code, _, err = await a.cli("undeploy", name)
        assert code == 0, err
