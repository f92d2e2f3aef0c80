"""Prefix routing across the mesh (issue 29, item 2), against three real agents running a
deployment of three mock engines with the prefix-cache model: a conversation's turns sent
round-robin through the three members reach the one replica its anchor names (counted by
the engines' own counters) and the engine reports cached prompt units from the second
turn on; the same turns with the `load` policy go where load alone sends them; a member
cordoned takes its replica out and the conversation moves to its next replica and stays
there; a flood of one prompt stays within the bound on its replica and spills to the rest.

Which replica an anchor names is computed here from the cluster's CA certificate, as every
member computes it (`scheduler.prefix`), so the test knows where each turn must go.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.load import parse_engine_load
from scheduler.prefix import anchor_key, anchor_of, limit, rendezvous

from ..deploy_harness import deployed, engine_cluster, post, replicas, set_policy
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

GPUS = {"a": "l4:1", "b": "l4:1", "c": "l4:1"}  # one replica on each member
PREFIX_ARGS = ["--prefix-cache-blocks", "256", "--block-units", "4", "--ttft-base-ms", "1"]
SYSTEM = "You are a careful assistant for the records office. " * 12


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    async for started in engine_cluster(tmp_path_factory.mktemp("prefix"), GPUS):
        body = {
            "name": "conv",
            "engine": "mock",
            "gpus": 1,
            "replicas": 3,
            "args": [*PREFIX_ARGS, "--latency-ms", "400"],
        }
        await deployed(started, body, within_s=60)
        yield started


def key_of(node: Node) -> bytes:
    ca = x509.load_pem_x509_certificate((node.home / "cluster" / "ca.crt").read_bytes())
    return anchor_key(ca.public_bytes(Encoding.DER))


def conversation(topic: str, turns: int, model: str = "conv") -> dict[str, Any]:
    """A chat body after `turns` exchanges: the system prompt, the first question, then
    answers and questions that grow the context."""
    messages = [{"role": "system", "content": f"On {topic}. {SYSTEM}"}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"{topic}: question {n} " + "detail " * 8})
        if n < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {n} " + "words " * 8})
    return {"model": model, "messages": messages, "max_tokens": 4}


async def engine_counts(
    node: Node, deployment: str = "conv"
) -> dict[str, tuple[float, float, float]]:
    """Replica id -> (requests, prompt units looked up, found) as each engine counts."""
    counts = {}
    async with aiohttp.ClientSession() as session:
        for replica in await replicas(node, deployment):
            url = f"http://127.0.0.1:{replica['port']}/metrics"
            async with session.get(url) as response:
                text = await response.text()
            values = {"requests": 0.0, "queries": 0.0, "hits": 0.0}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "vllm:request_success_total":
                        values["requests"] += sample.value
                    elif sample.name == "vllm:prefix_cache_queries_total":
                        values["queries"] += sample.value
                    elif sample.name == "vllm:prefix_cache_hits_total":
                        values["hits"] += sample.value
            counts[replica["id"]] = (values["requests"], values["queries"], values["hits"])
    return counts


def grown(
    before: dict[str, tuple[float, float, float]], after: dict[str, tuple[float, float, float]]
) -> dict[str, tuple[float, float, float]]:
    return {
        r: tuple(a - b for a, b in zip(after[r], before.get(r, (0, 0, 0)), strict=True))  # type: ignore[misc]
        for r in after
    }


async def chat(session: aiohttp.ClientSession, node: Node, body: dict[str, Any]) -> Any:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def talk(trio: list[Node], topic: str, turns: int, start: int = 0) -> list[int]:
    """The turns of one conversation, each through the next member; the cached prompt
    units each answer reports."""
    cached = []
    async with aiohttp.ClientSession() as session:
        for n in range(start, start + turns):
            answer = await chat(session, trio[n % 3], conversation(topic, n + 1))
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


async def idle_everywhere(trio: list[Node]) -> bool:
    for node in trio:
        for replica in await replicas(node, "conv"):
            if replica["running"] or replica["waiting"] or not replica["loadAt"]:
                return False
    return True


def expected(trio: list[Node], topic: str, ready: list[str]) -> str:
    anchor, _ = anchor_of(conversation(topic, 1), key_of(trio[0]))
    return rendezvous(anchor, ready)[0]


async def test_a_conversations_turns_reach_its_replica_through_every_member(
    trio: list[Node],
) -> None:
    ids = sorted(r["id"] for r in await replicas(trio[0], "conv"))
    # Conversations whose replica is not the one load alone picks when all are idle (the
    # lowest id): with the `load` policy their turns go elsewhere -- the control.
    topics = [t for t in (f"case {n}" for n in range(40)) if expected(trio, t, ids) != ids[0]]
    for topic in topics[:2]:
        before = await engine_counts(trio[0])
        cached = await talk(trio, topic, 4)
        moved = grown(before, await engine_counts(trio[0]))
        target = expected(trio, topic, ids)
        assert moved[target][0] == 4, (topic, target, moved)  # every turn on its replica
        assert all(moved[r][0] == 0 for r in ids if r != target), moved
        assert cached[0] == 0, cached  # a new conversation
        assert all(c > 0 for c in cached[1:]), cached
        assert moved[target][2] == sum(cached)  # the engine's own count of cached units
    # The control: with the load policy, a conversation that starts while every member
    # sees every replica idle starts on the lowest id, not on its anchor's replica.
    await set_policy(trio, "load")
    try:
        await eventually(lambda: idle_everywhere(trio), "every member sees every replica idle")
        before = await engine_counts(trio[0])
        await talk(trio, topics[2], 3)
        moved = grown(before, await engine_counts(trio[0]))
        assert moved[ids[0]][0] >= 1, moved
        assert moved[expected(trio, topics[2], ids)][0] < 3, moved
    finally:
        await set_policy(trio, "prefix")
    # Decisions by reason, on the member that placed them.
    decided = [
        await n.metric("nvpair_routing_decisions_total", model="conv", reason="prefix")
        for n in trio
    ]
    assert sum(decided) >= 8, decided  # the eight turns above, by the members that took them

    # The engines' own prefix-cache counters, per deployment, on the members running them.
    async def hits_counted() -> bool:
        hit = [await n.metric("nvpair_prefix_cache_hit_units_total", model="conv") for n in trio]
        looked = [
            await n.metric("nvpair_prefix_cache_prompt_units_total", model="conv") for n in trio
        ]
        return sum(hit) > 0 and all(h <= q for h, q in zip(hit, looked, strict=True))

    await eventually(hits_counted, "the engines' cache hits in the members' /metrics")
    shares = [await n.metric("nvpair_prefix_cache_hit_share", model="conv") for n in trio]
    assert max(shares) > 0.3, shares  # later turns: most of their prompt was cached


async def test_a_cordoned_members_conversations_move_and_stay(trio: list[Node]) -> None:
    ids = sorted(r["id"] for r in await replicas(trio[0], "conv"))
    node_of = {r["id"]: r["nodeId"] for r in await trio[0].get("/v1/replicas")}
    topic = "the moving case"
    first = expected(trio, topic, ids)
    cached = await talk(trio, topic, 2)
    assert cached[1] > 0
    gone_node = node_of[first]
    code, _, err = await trio[0].cli("node", "cordon", gone_node)
    assert code == 0, err
    try:

        async def cordoned_everywhere() -> bool:
            for node in trio:
                listed = {n["nodeId"]: n for n in await node.get("/v1/nodes")}
                if not listed[gone_node].get("cordoned"):
                    return False
            return True

        await eventually(cordoned_everywhere, "every member sees the cordon")
        rest = [r for r in ids if r != first]
        second = expected(trio, topic, rest)
        before = await engine_counts(trio[0])
        cached = await talk(trio, topic, 3, start=2)
        moved = grown(before, await engine_counts(trio[0]))
        assert moved[second][0] == 3, moved  # moved to its next replica, and stayed
        assert moved[first][0] == 0
        assert cached[0] == 0, cached  # a cold cache there, then warm
        assert cached[1] > 0, cached
        assert cached[2] > 0, cached
    finally:
        code, _, err = await trio[0].cli("node", "uncordon", gone_node)
        assert code == 0, err

    async def uncordoned_everywhere() -> bool:
        for node in trio:
            if any(n.get("cordoned") for n in await node.get("/v1/nodes")):
                return False
        return True

    await eventually(uncordoned_everywhere, "every member sees the uncordon")


async def test_a_flood_of_one_prompt_spills_past_the_bound(trio: list[Node]) -> None:
    # A deployment of its own whose engines hold each request 3 s: the whole flood is in
    # flight at once, so what the engines hold is what the member placed.
    body = {"name": "hot", "engine": "mock", "gpus": 0, "replicas": 3}
    await deployed(trio, {**body, "args": [*PREFIX_ARGS, "--latency-ms", "3000"]})
    ids = sorted(r["id"] for r in await replicas(trio[0], "hot"))
    port = {r["id"]: r["port"] for r in await replicas(trio[0], "hot")}
    topic = "the hot question"
    target = expected(trio, topic, ids)
    before = await engine_counts(trio[0], "hot")
    flood = 24
    most = 0  # the most requests the target engine held at once, by its own gauges
    async with aiohttp.ClientSession() as session:

        async def watch() -> None:
            nonlocal most
            url = f"http://127.0.0.1:{port[target]}/metrics"
            while True:
                async with session.get(url) as response:
                    load = parse_engine_load(await response.read(), at_ms=0)
                most = max(most, int(load.running + load.waiting))

        watching = asyncio.create_task(watch())
        try:
            await asyncio.gather(
                *(chat(session, trio[0], conversation(topic, 1, "hot")) for _ in range(flood))
            )
        finally:
            watching.cancel()
    moved = grown(before, await engine_counts(trio[0], "hot"))
    taken = {r: int(moved[r][0]) for r in ids}
    assert sum(taken.values()) == flood
    # Its replica takes the most, never past the bound: 1.25 x the mean of what is in
    # flight counting this one, rounded up -- at most 10 of 24 on three.
    assert taken[target] == max(taken.values()), taken
    assert 0 < most <= limit(flood - 1, 3), (most, taken)
    assert taken[target] <= limit(flood - 1, 3), taken
    assert sum(1 for count in taken.values() if count) >= 2, taken  # the rest spilled
    code, text = await post(trio[0], "/v1/deployments/hot/undeploy", {})
    assert code == 200, text


async def test_explain_shows_the_anchor_order_and_the_choice(
    trio: list[Node], tmp_path: Path
) -> None:
    await eventually(lambda: idle_everywhere(trio), "every member sees every replica idle")
    ids = sorted(r["id"] for r in await replicas(trio[0], "conv"))
    topic = "the explained case"
    prompt = tmp_path / "request.json"
    prompt.write_text(json.dumps(conversation(topic, 3)))  # a later turn: the same anchor
    code, out, err = await trio[1].cli("explain", "conv", "--prompt-file", str(prompt), "--json")
    assert code == 0, err
    shown = json.loads(out)
    order = rendezvous(anchor_of(conversation(topic, 1), key_of(trio[0]))[0], ids)
    assert [row["replicaId"] for row in shown["replicas"]] == order
    assert [row["order"] for row in shown["replicas"]] == [0, 1, 2]
    assert shown["choice"]["replicaId"] == order[0]
    assert shown["choice"]["reason"] == "prefix"
    assert "explained case" not in out  # the prompt is not said back
    code, out, err = await trio[1].cli("explain", "conv", "--prompt-file", str(prompt))
    assert code == 0, err
    assert f"chosen: {order[0]}" in out
    # Plain text is one user message; a session key anchors on the session.
    plain = tmp_path / "prompt.txt"
    plain.write_text("summarise the attached minutes")
    code, out, err = await trio[1].cli(
        "explain", "conv", "--prompt-file", str(plain), "--session", "s-1", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["session"] is True
    assert json.loads(out)["choice"]["reason"] == "session"
    # Bad input to the routing routes: a clear 400, the policy unchanged.
    for bad in (b'{"policy": "fastest"}', b"{not json", b'{"policy": 3}', b"[]"):
        code, text = await put(trio[1], "/v1/routing", bad)
        assert code == 400, (bad, text)
    for bad in (b'{"model": "conv"}', b'{"model": "", "request": {}}', b'{"request": []}'):
        code, text = await put(trio[1], "/v1/routing/explain", bad, method="POST")
        assert code == 400, (bad, text)
    assert (await trio[1].get("/v1/routing"))["policy"] == "prefix"


async def put(node: Node, path: str, body: bytes, method: str = "PUT") -> tuple[int, str]:
    headers = {**node.owner, "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.request(method, node.api + path, data=body) as response,
    ):
        return response.status, await response.text()
