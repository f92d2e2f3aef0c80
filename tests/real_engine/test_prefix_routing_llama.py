"""Prefix routing with llama.cpp's real server (issue 29): two replicas of the tiny model,
one slot each (`--parallel 1`: a slot keeps the KV cache of the last prompt it ran, so two
conversations on one server push each other's out). Two conversations, their turns
alternating and each turn sent through the next member: with prefix routing each
conversation keeps to its replica, and from the second turn on the server reports the
prompt tokens it reused (`timings.cache_n`) and evaluates only the new ones; with prefix
routing off (`round-robin`, which takes the replicas in turn: each member's turns
alternate, so both conversations meet on each slot and evict each other) the same turns
evaluate their whole prompt again, in more prompt time. The server's own `timings` say
so, not ours."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from scheduler.prefix import anchor_key, anchor_of, rendezvous
from tests.agent.deploy_harness import deployed, engine_cluster, replicas, set_policy
from tests.agent.harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

SYSTEM = " ".join(["the engine token world of the model"] * 120)  # long: worth caching
TURNS = 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(
    llama_server: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("prefix-llama")
    async for started in engine_cluster(root, {"a": None, "b": None}):
        body = {
            "name": "tiny-chat",
            "engine": "llamacpp",
            "source": str(tiny_model),
            "gpus": 0,
            "replicas": 2,
            "args": ["--parallel", "1"],
        }
        await deployed(started, body, within_s=120)
        yield started


def conversation(topic: str, turns: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": f"{topic} {SYSTEM}"}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"{topic} hello world {n}"})
        if n < turns - 1:
            messages.append({"role": "assistant", "content": "the model token engine"})
    return {"model": "tiny-chat", "messages": messages, "max_tokens": 4}


def first_replica(node: Node, topic: str, ids: list[str]) -> str:
    ca = x509.load_pem_x509_certificate((node.home / "cluster" / "ca.crt").read_bytes())
    anchor, _ = anchor_of(conversation(topic, 1), anchor_key(ca.public_bytes(Encoding.DER)))
    return rendezvous(anchor, ids)[0]


async def alternate(pair: list[Node], topics: list[str]) -> list[dict[str, float]]:
    """Each conversation's turns, alternating between them, each turn through the next
    member; the server's `timings` of every turn after each one's first."""
    later = []
    step = 0
    async with aiohttp.ClientSession() as session:
        for turn in range(1, TURNS + 1):
            for topic in topics:
                node = pair[step % 2]
                step += 1
                url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
                async with session.post(url, json=conversation(topic, turn)) as response:
                    assert response.status == 200, await response.text()
                    answer = await response.json()
                if turn > 1:
                    later.append(answer["timings"])
    return later


async def topics_apart(pair: list[Node], start: int) -> list[str]:
    """Two conversations whose anchors name different replicas."""
    ids = sorted(r["id"] for r in await replicas(pair[0], "tiny-chat"))
    by_replica: dict[str, str] = {}
    for n in range(start, start + 64):
        topic = f"user {n}"
        by_replica.setdefault(first_replica(pair[0], topic, ids), topic)
        if len(by_replica) == 2:
            return list(by_replica.values())
    raise AssertionError("no two topics apart in 64")


async def test_later_turns_reuse_the_prompt_with_prefix_routing_and_not_without(
    pair: list[Node],
) -> None:
    routed = await alternate(pair, await topics_apart(pair, 0))
    await set_policy(pair, "round-robin")
    try:
        unrouted = await alternate(pair, await topics_apart(pair, 100))
    finally:
        await set_policy(pair, "prefix")
    cached = [t["cache_n"] for t in routed]
    print("prefix:", [(t["cache_n"], t["prompt_n"], round(t["prompt_ms"], 2)) for t in routed])
    print("rr:    ", [(t["cache_n"], t["prompt_n"], round(t["prompt_ms"], 2)) for t in unrouted])
    # With prefix routing every later turn finds its conversation's prompt in its slot.
    assert all(c > 100 for c in cached), cached
    # Without it the two conversations share a slot and push each other out: the same
    # turns reuse less, evaluate more, and take longer over their prompts.
    assert sum(t["cache_n"] for t in unrouted) < sum(cached)
    assert sum(t["prompt_n"] for t in unrouted) > 2 * sum(t["prompt_n"] for t in routed)
    assert sum(t["prompt_ms"] for t in unrouted) > sum(t["prompt_ms"] for t in routed)

    # The server's own counters, per deployment, in the members' /metrics.
    async def counted() -> bool:
        hits = [
            await n.metric("nvpair_prefix_cache_hit_units_total", model="tiny-chat") for n in pair
        ]
        return sum(hits) >= sum(cached)

    await eventually(counted, "llama.cpp's reused prompt tokens in the members' /metrics")
