"""Engine load from Prometheus text (issue 13, item 5): the pure parser on real-looking
samples of vLLM, SGLang and llama.cpp, and the scraper against real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from agent.engines.load import (
    MAX_METRICS_BYTES,
    EngineLoad,
    EngineMetricsError,
    LoadScraper,
    ReplicaLoad,
    parse_engine_load,
)
from agent.mock.engine import MockEngine
from netkit.sites import start_site
from tests.fixtures.waiting import eventually

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.81
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.2
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:e2e_request_latency_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1234.0
"""

VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="/models/llama-2-7b"} 1.0
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="/models/llama-2-7b"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="/models/llama-2-7b"} 4.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="/models/llama-2-7b"} 0.5
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_vllm_series_of_every_engine_core_are_summed_and_the_fullest_cache_counts() -> None:
    assert parse_engine_load(VLLM, at_ms=5) == EngineLoad(5.0, 7.0, 0.81, 5)


def test_vllm_prefix_cache_counters_are_read_and_summed_over_restarts() -> None:
    counters = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 300\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 100\n'
        'vllm:prefix_cache_queries_created{model_name="m",engine="0"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 250\n'
    )
    load = parse_engine_load(VLLM + counters, at_ms=5)
    assert (load.cache_queries, load.cache_hits) == (400.0, 250.0)
    assert parse_engine_load(VLLM, at_ms=5).cache_queries is None  # not counted: unknown
    assert parse_engine_load(LLAMACPP, at_ms=0).cache_hits is None  # an older build
    # llama.cpp counts the prompt tokens it evaluated and those it reused from a slot.
    cached = "# TYPE llamacpp:prompt_tokens_cached_total counter\n"
    cached += "llamacpp:prompt_tokens_cached_total 114\n"
    llama = parse_engine_load(LLAMACPP + cached, at_ms=0)
    assert (llama.cache_queries, llama.cache_hits) == (6886.0 + 114.0, 114.0)
    # Summed by deployment across reads: what each engine counted since the last one; an
    # engine that restarted (its counters fell) counts from zero.
    scraper = LoadScraper(dict, label_of=lambda replica: "chat")
    scraper._count_cache("rep_a", 100, 40)
    scraper._count_cache("rep_a", 160, 90)
    scraper._count_cache("rep_b", 10, 0)
    scraper._count_cache("rep_a", 30, 20)  # restarted
    assert scraper.cache_totals == {"chat": [200.0, 110.0]}


def test_older_vllm_names_its_cache_gauge_gpu_cache_usage_perc() -> None:
    assert parse_engine_load(VLLM_OLD, at_ms=0) == EngineLoad(1.0, 4.0, 0.5, 0)


def test_sglang() -> None:
    assert parse_engine_load(SGLANG, at_ms=0) == EngineLoad(12.0, 5.0, 0.28, 0)


def test_llamacpp_without_a_kv_gauge_has_unknown_kv_usage() -> None:
    assert parse_engine_load(LLAMACPP, at_ms=0) == EngineLoad(2.0, 1.0, None, 0)
    older = LLAMACPP + "llamacpp:kv_cache_usage_ratio 0.63\n"
    assert parse_engine_load(older.encode(), at_ms=0).kv_usage == pytest.approx(0.63)


def test_garbage_in_series_it_does_not_read_is_ignored() -> None:
    noisy = "this is {not prometheus\n" + SGLANG + "sglang:other{ broken\n"
    assert parse_engine_load(noisy, at_ms=0) == EngineLoad(12.0, 5.0, 0.28, 0)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no load metrics"),
        ("<html>404 Not Found</html>", "no load metrics"),
        ('vllm:num_requests_running{model_name="m"} lots\n', "unreadable"),
        ('vllm:num_requests_running{model_name="m 1\n', "unreadable"),
        ("vllm:num_requests_waiting NaN\n", "not a count"),
        ("vllm:num_requests_waiting -3\n", "not a count"),
        (b"\xff\xfe vllm", "not UTF-8"),
        ("x" * (MAX_METRICS_BYTES + 1), "larger than"),
    ],
)
def test_unreadable_metrics_are_a_typed_error_that_says_why(text: str | bytes, says: str) -> None:
    with pytest.raises(EngineMetricsError, match=says):
        parse_engine_load(text, at_ms=0)


@given(st.text(max_size=300), st.sampled_from(["", "vllm:num_requests_running", "sglang:"]))
def test_nothing_but_a_typed_error_escapes_the_parser(noise: str, prefix: str) -> None:
    try:
        load = parse_engine_load(prefix + noise, at_ms=0)
    except EngineMetricsError:
        return
    assert load.running >= 0
    assert load.waiting >= 0


def test_replica_load_round_trips_through_a_record() -> None:
    load = EngineLoad(3.0, 1.0, 0.5, 1_764_000_000_000)
    wire = msgspec.json.encode(ReplicaLoad.of("rep_01", load))
    assert len(wire) < 120  # a few numbers per replica, no model names
    assert msgspec.json.decode(wire, type=ReplicaLoad).engine_load() == load
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(wire.replace(b'"waiting":1.0', b'"waiting":-1.0'), type=ReplicaLoad)


@pytest.fixture
async def hung_server() -> AsyncIterator[str]:
    """A server whose `/metrics` never answers (an engine stuck loading)."""
    release = asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    port = await start_site(runner, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    release.set()
    await runner.cleanup()


async def test_the_scraper_reads_a_real_engine_and_a_hung_one_never_blocks_it(
    hung_server: str,
) -> None:
    engine = MockEngine(model="m", latency_ms=60_000, max_concurrency=1)
    await engine.start()
    targets = {"rep_live": engine.url, "rep_hung": hung_server, "rep_down": "http://127.0.0.1:9"}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    try:
        async with LoadScraper(lambda: targets, timeout_s=0.5) as scraper:
            async with aiohttp.ClientSession() as client:
                calls = [
                    asyncio.create_task(client.post(engine.url + "/v1/chat/completions", json=body))
                    for _ in range(3)
                ]

                async def sees_the_queue() -> bool:
                    await scraper.scrape()
                    load = scraper.current().get("rep_live")
                    return load is not None and (load.running, load.waiting) == (1.0, 2.0)

                await eventually(sees_the_queue, "the scraper reads 1 running, 2 waiting")
                assert set(scraper.current()) == {"rep_live"}
                assert set(scraper.failures) == {"rep_hung", "rep_down"}
                assert scraper.current()["rep_live"].kv_usage == 1.0
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
            del targets["rep_live"]
            await scraper.scrape()
            assert scraper.current() == {}  # a replica that is gone leaves no load behind
    finally:
        await engine.aclose()
