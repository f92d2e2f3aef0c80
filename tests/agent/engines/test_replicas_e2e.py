"""Deployments run (issue 13): three real agents on simulated GPUs -- 8 x h100 in one NVLink
domain, 4 x h100 in two domains of 2, 2 x l4 -- launch mock engines as replicas. Three
replicas of two GPUs come up on distinct GPUs, `ready` in every member's view, and serve
requests through any member with the `openai` client; a tensor-parallel-4 one-domain
deployment never lands on the node whose domains hold 2 each; scaling down stops engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from ..deploy_harness import alive, engine_cluster, engine_pids, post, ready_everywhere, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

GPUS = {"big": "h100-80gb-sxm:8", "split": "h100-80gb-sxm:2,h100-80gb-sxm:2", "small": "l4:2"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    async for started in engine_cluster(tmp_path_factory.mktemp("replicas"), GPUS):
        yield started


async def test_three_replicas_of_two_gpus_serve_through_any_member(trio: list[Node]) -> None:
    body = {"name": "chat-3x2", "engine": "mock", "gpus": 2, "replicas": 3}
    code, text = await post(trio[0], "/v1/deployments", body)
    assert code == 201, text
    await eventually(
        lambda: ready_everywhere(trio, "chat-3x2", 3),
        "three ready replicas of chat-3x2 in every member's view",
        within_s=60,
    )
    seen = await replicas(trio[2], "chat-3x2")
    devices = [d for r in seen for d in r["devices"]]

    async def versions_known() -> bool:  # each engine asked what it is, once ready
        got = [r["engineVersion"] for r in await replicas(trio[2], "chat-3x2")]
        return all(v.startswith("nvpair-mock ") for v in got)

    await eventually(versions_known, "every replica's engine version in the records")
    assert len(devices) == len(set(devices)) == 6  # every replica on distinct GPUs
    # Served through any member, with the openai client.
    for node in trio:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{node.ports['facade']}/v1", api_key="unused"
        )
        async with client:
            listed = [m.id for m in (await client.models.list()).data]
            assert "chat-3x2" in listed  # a deployment with a ready replica is a model
            answer = await client.chat.completions.create(
                model="chat-3x2", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
        assert answer.choices[0].message.content
    # Each engine runs once, as a real process, on the node its replica says.
    pids = {n.name: engine_pids(n.home) for n in trio}
    assert sum(len(p) for p in pids.values()) == 3
    assert all(alive(pid) for p in pids.values() for pid in p.values())


async def test_a_tp4_one_domain_deployment_never_lands_on_the_split_node(
    trio: list[Node],
) -> None:
    body = {
        "name": "tp4",
        "engine": "mock",
        "gpus": 4,
        "replicas": 2,
        "constraints": {"oneDomain": True},
    }
    code, text = await post(trio[1], "/v1/deployments", body)
    assert code == 201, text
    # big has 8 in one domain, 2 of them held by chat-3x2 at most: room for one TP-4 group
    # of four; split has 2 + 2 and must never take one; small has l4s, 2 of them.
    await eventually(lambda: ready_everywhere(trio, "tp4", 1), "one ready tp4 replica", within_s=60)
    seen = await replicas(trio[0], "tp4")
    assert {r["node"] for r in seen} == {"big"}
    # The second is reported unplaceable, not put on split.
    split_id = await trio[1].node_id()
    assert all(r["nodeId"] != split_id for r in await replicas(trio[1], "tp4"))
    code, out, err = await trio[1].cli("replicas")
    assert code == 0, err
    assert "tp4" in out


async def test_scale_down_stops_engines(trio: list[Node]) -> None:
    before = {rid: pid for n in trio for rid, pid in engine_pids(n.home).items()}
    code, text = await post(trio[0], "/v1/deployments/chat-3x2/scale", {"replicas": 1})
    assert code == 200, text
    await eventually(lambda: ready_everywhere(trio, "chat-3x2", 1), "chat-3x2 down to one replica")
    after = {rid for n in trio for rid in engine_pids(n.home)}
    stopped = [pid for rid, pid in before.items() if rid not in after]
    assert len(stopped) == 2
    await eventually(lambda: _none_alive(stopped), "the stopped engines' processes are gone")


async def _none_alive(pids: list[int]) -> bool:
    return not any(alive(pid) for pid in pids)
