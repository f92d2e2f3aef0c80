"""One agent, API keys and a queue limit: 401 without a key, the key's name on the job,
429 with Retry-After when the only member is full."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from ..harness import Engine, Node, eventually, make_node, start_cluster, start_engine


@pytest.fixture
async def single(tmp_path: Path) -> AsyncIterator[tuple[Node, Engine]]:
    engine = await start_engine("slow", "--latency-ms", "1500")
    node = make_node(tmp_path, "solo", "l4:1")
    node.extra = ["--engine", f"vllm={engine.url}"]
    node.home.mkdir(parents=True)
    (node.home / "nvpair.toml").write_text(
        # wait_queue = 0: a full member refuses at once, as before the wait line
        '[agent]\nqueue_limit = 1\nwait_queue = 0\napi_keys = { "team-a" = "sk-test-123" }\n'
    )
    (node.home / "nvpair.toml").chmod(0o600)  # it holds API keys: others may not read it
    try:
        async for started in start_cluster([node]):
            yield started[0], engine
    finally:
        await engine.stop()


async def post(node: Node, key: str | None) -> aiohttp.ClientResponse:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "slow", "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions",
            json=body,
            headers=headers,
        )
        await response.read()
        return response


async def get(node: Node, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"http://127.0.0.1:{node.ports['facade']}{path}"
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as got:
        return got.status


async def test_keys_requester_and_queue_full(single: tuple[Node, Engine]) -> None:
    node, _ = single
    for key in (None, "sk-wrong"):
        response = await post(node, key)
        assert response.status == 401
    # The model list and each model obey the keys too (the control: the right key).
    for path in ("/v1/models", "/v1/models/slow"):
        for key, status in ((None, 401), ("sk-wrong", 401), ("sk-test-123", 200)):
            assert await get(node, path, key) == status, (path, key)
    in_flight = asyncio.create_task(post(node, "sk-test-123"))

    async def first_is_running() -> bool:
        return any(j["state"] == "running" for j in await node.jobs())

    # The second request comes once the first is placed and running, so the queue is full.
    await eventually(first_is_running, "the first request runs")
    second = await post(node, "sk-test-123")
    first = await in_flight
    assert first.status == 200
    assert second.status == 429
    assert second.headers["Retry-After"] == "1"
    [job] = await node.get_settled_jobs(1)
    assert job["requesterId"] == "team-a"
    assert job["state"] == "completed"
