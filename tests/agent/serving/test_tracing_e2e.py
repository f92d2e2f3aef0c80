"""Traces across members (issue 31, item 2), on two real agents and a real mock engine, each
sending its spans over OTLP/HTTP to a small receiver the test runs (decoding them with
opentelemetry-proto): a request entering a and served on b is one trace -- the client's --
with a's spans, then b's, then the engine's, each the child of the one before it; no span
holds the prompt; /metrics counts the spans exported; and a's log lines (JSON) of the
request carry its request, job and trace ids. (The plane's calls:
tests/plane/http/test_plane_traces.py.)"""

from __future__ import annotations

import itertools
import json
import os
import secrets
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.otlp import Received, Receiver

from ..harness import Engine, Node, eventually, make_node, start_cluster, start_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "traced"
MARKER = "PROMPT-MARKER-7ace"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver.running() as started:
        yield started


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(receiver: Receiver) -> AsyncIterator[Engine]:
    with pytest.MonkeyPatch.context() as env:  # the engine inherits the test's environment
        env.setitem(os.environ, "OTEL_BSP_SCHEDULE_DELAY", "100")
        started = await start_engine(MODEL, "--otlp-traces-endpoint", receiver.url)
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    receiver: Receiver,
    engine: Engine,
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("tracing")
    nodes = [make_node(root, "a", None), make_node(root, "b", None)]
    nodes[0].extra = ["--log-format", "json"]  # for log shippers: the request's ids as fields
    nodes[1].extra = ["--engine", f"vllm={engine.url}"]
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text(f'[tracing]\notlp_endpoint = "{receiver.url}"\n')
        node.extra_env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export each 0.1 s, not each 5 s
    async for started in start_cluster(nodes):

        async def a_sees_b_serve(a: Node = started[0]) -> bool:
            models = (await a.get_facade("/v1/models"))["data"]
            return any(m["id"] == MODEL for m in models)

        await eventually(a_sees_b_serve, "a's facade lists b's model")
        yield started


async def test_a_request_entering_a_and_served_on_b_is_one_trace(
    cluster: list[Node], receiver: Receiver
) -> None:
    a, b = cluster
    a_id, b_id = await a.node_id(), await b.node_id()
    # The client's own trace: the request's spans join it.
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": MARKER}], "max_tokens": 3}
    url = f"http://127.0.0.1:{a.ports['facade']}/v1/chat/completions"
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"] == "tok0 tok1 tok2"

    chain = ["POST /v1/chat/completions", "nvpair.forward", "nvpair.forwarded", "nvpair.engine"]
    names = {*chain, "nvpair.route", "llm_request"}

    await eventually(
        lambda: names <= set(receiver.of_trace(trace_id)), "every member's spans of the request"
    )
    spans = receiver.of_trace(trace_id)
    request, route, llm = spans[chain[0]], spans["nvpair.route"], spans["llm_request"]
    # Each the child of the one before it: the client's span, a's, b's, the engine's.
    assert request.parent_id == client_span
    assert route.parent_id == request.span_id
    for parent, child in itertools.pairwise(chain):
        assert spans[child].parent_id == spans[parent].span_id, (parent, child)
    assert llm.parent_id == spans["nvpair.engine"].span_id
    # ... from the member (or the engine) that did the work, in order.
    assert [spans[n].instance for n in chain] == [a_id, a_id, b_id, b_id]
    assert (llm.service, request.service) == ("mock-engine", "nvpair-agent")
    starts = [spans[n].start_ns for n in [*chain, "llm_request"]]
    assert starts == sorted(starts)
    assert request.end_ns >= spans["nvpair.forward"].end_ns >= spans["nvpair.forward"].start_ns

    # What the spans say: the job, the choice and why, the outcome.
    assert request.attributes["gen_ai.request.model"] == MODEL
    assert request.attributes["nvpair.job.origin"] == a_id
    assert request.attributes["nvpair.job.state"] == "completed"
    assert request.attributes["http.response.status_code"] == 200
    assert isinstance(request.attributes["nvpair.job.id"], str)
    assert route.attributes["nvpair.route.reason"] == "load"
    assert route.attributes["nvpair.target.node_id"] == b_id
    assert isinstance(route.attributes["nvpair.route.score"], float)
    assert spans["nvpair.engine"].attributes["http.response.status_code"] == 200

    # a's log lines of the request name it, its job and its trace (item 3).
    job = f"{request.attributes['nvpair.job.run_id']}/{request.attributes['nvpair.job.id']}"
    assert a.log is not None  # started
    said = a.log.read_text().splitlines()
    lines = [json.loads(line) for line in said if line.startswith("{")]
    placed = [line for line in lines if line["message"].startswith(f"{MODEL} placed on")]
    assert placed, "a says where it placed the request"
    assert placed[-1]["job_id"] == job
    assert placed[-1]["trace_id"] == trace_id
    assert placed[-1]["request_id"].startswith("req_")
    assert all(MARKER not in line for line in said)
    # The workload manager child writes the agent's format too.
    assert any(line["logger"].startswith("workload_manager") for line in lines)

    # The prompt is in no span, nor anywhere in what was exported (the model, which the
    # same body named, is: the bodies are where the prompt would be).
    exported = b"".join(receiver.bodies)
    assert MODEL.encode() in exported
    assert MARKER.encode() not in exported


async def test_a_request_without_a_good_callers_trace_starts_one_and_metrics_count_spans(
    cluster: list[Node], receiver: Receiver
) -> None:
    a, _ = cluster
    before = len(receiver.spans)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = f"http://127.0.0.1:{a.ports['facade']}/v1/chat/completions"
    # A malformed context is no context: the request is served, and starts a trace.
    headers = {"traceparent": "00-" + "z" * 32 + "-" + "0" * 16 + "-01", "tracestate": "x" * 600}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        assert r.status == 200
        request_id = r.headers["X-Request-Id"]
    assert request_id

    def new_root() -> list[Received]:
        return [
            s
            for s in receiver.spans[before:]
            if s.name == "POST /v1/chat/completions" and s.parent_id == ""
        ]

    await eventually(lambda: bool(new_root()), "a root span for a request no caller traced")
    trace_id = new_root()[0].trace_id
    await eventually(
        lambda: "llm_request" in receiver.of_trace(trace_id), "the engine's span in its trace"
    )

    async def exported() -> float:
        return await a.metric("nvpair_trace_spans_total", outcome="exported")

    async def some_exported() -> bool:
        return await exported() > 0

    await eventually(some_exported, "a's /metrics counts the spans it exported")
    a_id = await a.node_id()
    assert await exported() <= sum(1 for s in receiver.spans if s.instance == a_id)
    assert await a.metric("nvpair_trace_spans_total", outcome="dropped") == 0
