"""`/metrics` against the Grafana dashboard and docs/metrics.md (issue 17, item 7).

Two real agents with simulated GPUs and a deployment of the mock engine; requests through
`a`'s facade with the real `openai` client, one streamed. `a`'s `/metrics` parses with
prometheus_client's parser, holds every name the dashboard's expressions use and every
name docs/metrics.md lists (and the page lists every name it exports), and its histograms
count the requests made. Label values a client sends but the cluster does not know count
as `other` (unit tests of the bounded labels).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from agent.metric_labels import OTHER, FirstSeen, bounded
from agent.serving_metrics import ServingMetrics
from agent.usage import Meter
from agent.usage_book import UsageMetrics
from broker.deployments import Deployment
from workload_manager.workload import Workload, WorkloadState

from .deploy_harness import engine_cluster, post, ready_everywhere
from .harness import Node, eventually

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "nvpair.json"
DOC = ROOT / "docs" / "metrics.md"
NAME = re.compile(r"\bnvpair_[a-z0-9_]+")


def dashboard_names() -> set[str]:
    """Every metric name in the dashboard's `expr` fields."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.update(NAME.findall(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def documented() -> tuple[set[str], set[str]]:
    """The names in docs/metrics.md's tables: (always exported, only with a plane)."""
    always: set[str] = set()
    plane: set[str] = set()
    into = always
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            into = plane if "plane" in line.lower() else always
        elif line.startswith("| `nvpair_"):
            into.add(line.split("`")[1])
    return always, plane


async def scrape(node: Node) -> tuple[dict[str, Any], str]:
    async with aiohttp.ClientSession() as session, session.get(node.api + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """One sample's value, 0 when absent."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def exported(family: Any) -> str:
    """The name a family is documented and queried under (a counter's with `_total`)."""
    return f"{family.name}_total" if family.type == "counter" else str(family.name)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    gpus = {"a": "l4:1", "b": "l4:1"}
    async for started in engine_cluster(tmp_path_factory.mktemp("metrics"), gpus):
        code, text = await post(started[0], "/v1/deployments", {"name": "chat", "engine": "mock"})
        assert code == 201, text
        ready = functools.partial(ready_everywhere, started, "chat", 1)
        await eventually(ready, "chat ready on a and b", within_s=60)
        yield started


@pytest.mark.asyncio(loop_scope="module")
async def test_metrics_hold_the_dashboards_and_the_docs_names(pair: list[Node]) -> None:
    a, b = pair
    before, _ = await scrape(a)
    assert value(before, "nvpair_request_duration_seconds_count", model="chat") == 0
    oa = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{a.ports['facade']}/v1", api_key="x")
    async with oa:
        for _ in range(2):
            await oa.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "SECRET-PROMPT"}]
            )
        stream = await oa.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "SECRET-PROMPT"}], stream=True
        )
        assert [c async for c in stream]
    b_id = await b.node_id()

    async def broadcast_to_b() -> bool:  # the jobs' records reached b, counted per peer
        families, _ = await scrape(a)
        return value(families, "nvpair_broadcast_events_sent_total", peer=b_id) > 0

    await eventually(broadcast_to_b, "a's events to b counted under peer b")
    families, text = await scrape(a)
    assert "SECRET-PROMPT" not in text
    # The histograms count the requests made: three ended, one of them streamed.
    assert value(families, "nvpair_request_duration_seconds_count", model="chat") == 3
    assert value(families, "nvpair_time_to_first_token_seconds_count", model="chat") == 1
    assert value(families, "nvpair_requests_total", model="chat", outcome="completed") == 3
    assert value(families, "nvpair_wait_line_requests", model="chat") == 0  # a series, idle
    # The one replica is ready on a or on b; a shows a zero for each state it has none in.
    b_families, _ = await scrape(b)
    ready = [
        value(f, "nvpair_replicas", deployment="chat", state="ready")
        for f in (families, b_families)
    ]
    assert sorted(ready) == [0, 1]
    assert value(families, "nvpair_deployment_desired_replicas", deployment="chat") == 1

    samples = {s.name for f in families.values() for s in f.samples}
    assert dashboard_names() - samples == set()  # every name the dashboard uses, with data
    always, plane = documented()
    names = {exported(f) for f in families.values()}
    assert always - names == set()  # every documented name is exported
    # prometheus_client adds a `<name>_created` timestamp beside each counter and histogram.
    created = {f"{n.removesuffix('_total')}_created" for n in always}
    ours = {n for n in names if n.startswith("nvpair_")} - created
    assert ours - always - plane == set()  # and every exported name is documented


def _job(model: str, *, placed: bool, requester: str | None = None) -> Workload:
    job = Workload(
        id="1",
        model=model,
        engine="vllm",
        runId="run",
        state=WorkloadState.COMPLETED,
        originatedFrom="nod_a",
        createdAt=1,
        requesterId=requester,
        seq=1,
    )
    # Placed: a model some member serves (the facade places nothing else).
    return msgspec.structs.replace(job, scheduledOn="nod_b") if placed else job


def test_unknown_model_names_count_as_other() -> None:
    assert bounded("llama", {"llama"}) == "llama"
    assert bounded("a-name-no-member-serves", {"llama"}) == OTHER
    first = FirstSeen(limit=2)
    assert [first(v) for v in ("m1", "m2", "m3", "m1")] == ["m1", "m2", OTHER, "m1"]

    usage = UsageMetrics()
    meter = Meter()
    meter.finish()
    usage.count(_job("client-made-up-model", placed=False), meter)  # never placed
    usage.count(_job("llama", placed=True, requester="team-a"), meter)
    (family,) = usage.requests.collect()
    models = {s.labels["model"] for s in family.samples}
    assert models == {OTHER, "llama"}

    dep = Deployment(id="dep_" + "0" * 26, name="chat", engine="mock")
    serving = ServingMetrics(
        waiting=lambda: {"chat": 2, "made-up-1": 1, "made-up-2": 4},
        in_flight=dict,
        replicas=list,
        deployments=lambda: [dep],
        models=lambda: ["llama"],
    )
    line = next(f for f in serving.collect() if f.name == "nvpair_wait_line_requests")
    assert {s.labels["model"]: s.value for s in line.samples} == {
        "chat": 2,
        "llama": 0,
        OTHER: 5,
    }


def test_the_dashboard_imports_with_a_prometheus_input() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])  # ids unique
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for left, right in ("()", "{}", "[]"):
                assert expr.count(left) == expr.count(right), expr  # a typo breaks a panel
    titles = " ".join(p["title"] for p in panels).lower()
    for wanted in ("latency", "first token", "tokens/s per model", "per key", "wait line"):
        assert wanted in titles
