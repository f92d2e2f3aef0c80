"""The mock engine's `/metrics` (issue 13, item 5): vLLM's names and labels, with values that
follow the requests it really runs and queues under `--max-concurrency`."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.load import EngineLoad, parse_engine_load
from agent.mock.engine import MockEngine
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import free_port

BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


async def load_of(session: aiohttp.ClientSession, url: str) -> EngineLoad:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        load = parse_engine_load(await response.read(), at_ms=0)
    return dataclasses.replace(load, cache_queries=None, cache_hits=None)  # load alone


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_requests_beyond_max_concurrency_wait_and_metrics_say_so(
    session: aiohttp.ClientSession,
) -> None:
    engine = MockEngine(model="m,other", latency_ms=60_000, max_concurrency=2)
    await engine.start()
    try:
        calls = [
            asyncio.create_task(session.post(engine.url + "/v1/chat/completions", json=BODY))
            for _ in range(5)
        ]

        async def queued() -> bool:
            return await load_of(session, engine.url) == EngineLoad(2.0, 3.0, 1.0, 0)

        await eventually(queued, "2 running and 3 waiting at max concurrency 2")
        async with session.get(engine.url + "/metrics") as response:
            text = await response.text()
        series = {
            (s.name, s.labels["model_name"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert series[("vllm:num_requests_running", "m")] == 2.0
        assert series[("vllm:num_requests_waiting", "m")] == 3.0
        assert series[("vllm:num_requests_running", "other")] == 0.0
        assert series[("vllm:kv_cache_usage_perc", "m")] == 1.0
        for call in calls:  # clients that go away free their slots and leave the queue
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

        async def idle() -> bool:
            return await load_of(session, engine.url) == EngineLoad(0.0, 0.0, 0.0, 0)

        await eventually(idle, "nothing running or waiting once the clients left")
    finally:
        await engine.aclose()


async def test_queued_requests_are_all_served_in_turn(session: aiohttp.ClientSession) -> None:
    engine = MockEngine(model="m", latency_ms=20, max_concurrency=1)
    await engine.start()
    try:

        async def call() -> int:
            async with session.post(engine.url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(call() for _ in range(4))) == [200] * 4
        assert engine.requests == 4
        assert await load_of(session, engine.url) == EngineLoad(0.0, 0.0, 0.0, 0)
    finally:
        await engine.aclose()


async def test_the_command_line_flag_limits_a_real_engine_process(
    session: aiohttp.ClientSession,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["--model", "m", "--port", str(port), "--latency-ms", "60000", "--max-concurrency", "1"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "mock-engine", *argv, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert b"mock engine serving" in await proc.stdout.readline()
        calls = [
            asyncio.create_task(session.post(url + "/v1/chat/completions", json=BODY))
            for _ in range(3)
        ]

        async def one_runs() -> bool:
            return await load_of(session, url) == EngineLoad(1.0, 2.0, 1.0, 0)

        await eventually(one_runs, "1 running, 2 waiting in the engine process")
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    finally:
        proc.terminate()
        await proc.wait()


async def test_a_startup_delay_keeps_the_port_closed_until_the_engine_has_loaded(
    session: aiohttp.ClientSession,
) -> None:
    # `--startup-s` (issue 30's cold starts): as a real engine, it listens once loaded.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["--model", "m", "--port", str(port), "--startup-s", "3"]
    proc = await asyncio.create_subprocess_exec(  # the mock alone, as the template starts it
        sys.executable, "-m", "agent.mock", "mock-engine", *argv, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert b"mock engine loading for 3s" in await proc.stdout.readline()
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(url + "/v1/models")  # loading: nothing listens
        assert b"mock engine serving" in await proc.stdout.readline()
        async with session.get(url + "/v1/models") as r:  # the control: loaded, it answers
            assert r.status == 200
    finally:
        proc.terminate()
        await proc.wait()


async def test_the_startup_delay_counts_from_the_process_start() -> None:
    # A real engine's load time includes its own imports: `--startup-s` is the time from
    # the process's start, so the mock waits that long less what its start-up took.
    code = (
        "import time; time.sleep(0.3); from agent.mock.engine import _since_start as s; print(s())"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert float(out) >= 0.3  # at least the sleep before it was asked
