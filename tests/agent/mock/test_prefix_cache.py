"""The mock engine's modelled prefix cache (issue 29, item 1): the pure model -- chained
block names, the longest cached prefix of whole blocks, LRU eviction, vLLM's counters --
and a real engine process that reports what it reused as vLLM and OpenAI do
(`usage.prompt_tokens_details.cached_tokens`, `vllm:prefix_cache_*_total`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.mock.prefix_cache import PrefixCache, block_names
from tests.workload_manager.cluster_harness import free_port

SYSTEM = [f"sys{i}" for i in range(12)]  # three blocks of four


def test_a_conversations_next_turn_reuses_its_whole_blocks() -> None:
    cache = PrefixCache(capacity=64, block=4)
    first = [*SYSTEM, "hello", "there"]  # three full blocks and a partial one
    assert cache.admit(first) == 0  # nothing cached yet
    second = [*first, "answer", "words", "and", "more", "x"]
    assert cache.admit(second) == 12  # the partial block of the first turn was never cached
    assert cache.admit(second) == 16  # now all four of its full blocks are
    assert (cache.queries, cache.hits) == (14 + 19 + 19, 0 + 12 + 16)


def test_a_block_is_named_by_everything_before_it() -> None:
    other = ["other", *SYSTEM[1:]]  # the same words from the second on
    ours, theirs = block_names(SYSTEM, 4), block_names(other, 4)
    assert ours[0] != theirs[0]
    assert ours[1] != theirs[1]  # same words, different prefix: a different block
    cache = PrefixCache(capacity=64, block=4)
    cache.admit(SYSTEM)
    assert cache.admit(other) == 0
    assert block_names(SYSTEM[:3], 4) == []  # no full block, nothing to name


def test_the_least_recently_used_blocks_go_first_and_no_cache_reuses_nothing() -> None:
    cache = PrefixCache(capacity=3, block=4)
    a = [f"a{i}" for i in range(12)]
    b = [f"b{i}" for i in range(8)]
    cache.admit(a)
    cache.admit(b)  # three blocks held at most: two of a's go
    assert cache.admit(b) == 8
    assert cache.admit(a) == 0  # its first block went: its prefix is gone
    assert cache.used == 1.0
    none = PrefixCache(capacity=0, block=4)
    none.admit(a)
    assert none.admit(a) == 0
    assert none.used == 0.0
    with pytest.raises(ValueError, match="block"):
        PrefixCache(capacity=4, block=0)


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    port = free_port()
    argv = ["--model", "m", "--port", str(port), "--prefix-cache-blocks", "64",
            "--block-units", "4", "--ttft-base-ms", "5", "--prefill-ms-per-unit", "20"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "mock-engine", *argv, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert b"mock engine serving" in await proc.stdout.readline()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        await proc.wait()


async def ask(
    session: aiohttp.ClientSession, url: str, words: list[str], *, stream: bool
) -> dict[str, int]:
    message = {"role": "user", "content": " ".join(words)}
    body = {"model": "m", "messages": [message], "max_tokens": 2, "stream": stream,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        if not stream:
            usage = (await response.json())["usage"]
        else:
            lines = [line async for line in response.content if line.startswith(b"data: {")]
            usage = json.loads(lines[-1][6:])["usage"]
    return {"prompt": usage["prompt_tokens"], **usage["prompt_tokens_details"]}


async def test_a_real_engine_reports_what_it_reused(engine: str) -> None:
    turn = [*SYSTEM, *(f"w{i}" for i in range(20))]  # 32 words: 8 blocks
    async with aiohttp.ClientSession() as session:
        cold = await ask(session, engine, turn, stream=False)
        warm = await ask(session, engine, [*turn, "next"], stream=True)
        async with session.get(engine + "/metrics") as response:
            text = await response.text()
    assert cold == {"prompt": 32, "cached_tokens": 0}
    assert warm == {"prompt": 33, "cached_tokens": 32}
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name") == "m"
    }
    assert samples["vllm:prefix_cache_queries_total"] == 65
    assert samples["vllm:prefix_cache_hits_total"] == 32
