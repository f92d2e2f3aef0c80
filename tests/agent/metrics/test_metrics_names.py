"""`/metrics` against the Grafana dashboard and docs/metrics.md (issue 17, item 7; issue 25).

Two real agents with simulated GPUs and a deployment of the mock engine; requests through
`a`'s facade with the real `openai` client, one streamed. `a`'s `/metrics` parses with
prometheus_client's parser, holds every name the dashboard's expressions use and every
name docs/metrics.md lists (and the page lists every name it exports), and its histograms
count the requests made. Before the first request, every series of the deployment's model
is there at zero; a key's come with it and go when it is revoked, the model's when it is
undeployed (the module's tests run in order: the last ones change the cluster). Label
values a client sends but the cluster does not know count as `other`, and the series made
ahead are bounded (unit tests).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from agent.core.metric_aliases import DEPRECATED
from agent.core.metric_labels import OTHER, FirstSeen, bounded
from agent.metrics.serving import ServingMetrics
from agent.serving.usage import Meter
from agent.serving.usage_metrics import NO_KEY, OUTCOMES, UsageMetrics
from facts.deployments import Deployment
from workload_manager.workload import Workload, WorkloadState

from ..deploy_harness import engine_cluster, post, ready_everywhere
from ..harness import Node, eventually

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "docs" / "grafana" / "nvpair.json"
DOC = ROOT / "docs" / "metrics.md"
NAME = re.compile(r"\bnvpair_[a-z0-9_]+")
RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*(nvpair_[a-z0-9_]+)")


def dashboard_exprs() -> list[str]:
    """Every `expr` of the dashboard's panels."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def dashboard_names() -> set[str]:
    """Every metric name in the dashboard's `expr` fields."""
    return {name for expr in dashboard_exprs() for name in NAME.findall(expr)}


def doc_rows() -> dict[str, tuple[str, str, bool]]:
    """docs/metrics.md's table rows: name -> (type, meaning, only with a plane, with
    tracing on or while something runs: a section that says so in its title)."""
    rows: dict[str, tuple[str, str, bool]] = {}
    plane = False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            plane = any(word in line.lower() for word in ("plane", "tracing", "only while"))
        elif line.startswith("| `nvpair_"):
            cells = [cell.strip() for cell in line.split("|")]
            rows[cells[1].strip("`")] = (cells[2], cells[4], plane)
    return rows


def documented() -> tuple[set[str], set[str]]:
    """The names in docs/metrics.md's tables: (always exported, only with a plane or with
    tracing on)."""
    rows = doc_rows()
    return {n for n, r in rows.items() if not r[2]}, {n for n, r in rows.items() if r[2]}


async def scrape(node: Node) -> tuple[dict[str, Any], str]:
    async with aiohttp.ClientSession() as session, session.get(node.api + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    # By the name queried: a counter and its deprecated gauge share a family name.
    return {exported(f): f for f in text_string_to_metric_families(text)}, text


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """One sample's value, 0 when absent."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def found(families: dict[str, Any], sample: str, **labels: str) -> list[float]:
    """The values of every sample named `sample` whose labels include `labels`."""
    return [
        float(s.value)
        for family in families.values()
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def zero_series(families: dict[str, Any], model: str, key: str) -> list[list[float]]:
    """The request, token, latency and TTFT series of `model` and `key` (one list each)."""
    return [
        *(found(families, "nvpair_requests_total", model=model, key=key, outcome=o.value)
          for o in OUTCOMES),
        *(found(families, "nvpair_tokens_total", model=model, key=key, kind=kind)
          for kind in ("prompt", "completion")),
        found(families, "nvpair_request_duration_seconds_count", model=model),
        found(families, "nvpair_time_to_first_token_seconds_count", model=model),
        found(families, "nvpair_request_duration_seconds_bucket", model=model, le="+Inf"),
    ]  # fmt: skip


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
async def test_every_series_of_a_known_model_is_zero_before_its_first_request(
    pair: list[Node],
) -> None:
    # The deployment is known on both members (b learnt it from a's push); no request yet.
    # A series born at the first scrape after a burst would make rate() miss the burst.
    for node in pair:
        families, _ = await scrape(node)
        assert zero_series(families, "chat", NO_KEY) == [[0.0]] * 8, node.name
        # A request placed nowhere (no capacity, waited too long) counts under `other`.
        assert found(families, "nvpair_requests_total", model=OTHER, outcome="failed") == [0]


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
    rows = doc_rows()
    for name in always:  # with its type: every count a counter, queried with rate()
        assert families[name].type == rows[name][0], name


@pytest.mark.asyncio(loop_scope="module")
async def test_counts_are_counters_with_help_of_their_own(pair: list[Node]) -> None:
    families, text = await scrape(pair[0])
    ours = {n: f for n, f in families.items() if n.startswith("nvpair_")}
    # Each family says what it is, not a template filled in with its name (a `_created`
    # timestamp has its counter's or histogram's, from prometheus_client).
    helps = [f.documentation for n, f in ours.items() if not n.endswith("_created")]
    assert all(helps)
    assert len(set(helps)) == len(helps)
    # Every gauge that counted before is kept, deprecated, beside its counter.
    rows = doc_rows()
    for old, (_meaning, instead, _labels) in DEPRECATED.items():
        assert "**Deprecated**" in rows[old][1], old
        assert instead in rows[old][1], old
        if old.startswith("nvpair_plane_"):
            continue  # only exported with a plane
        assert ours[old].type == "gauge"
        assert ours[instead.split("{")[0]].type == "counter"
        assert f"use {instead}" in ours[old].documentation
    assert {"nvpair_manager_restarts_total", "nvpair_anti_entropy_rounds_total"} <= set(ours)
    assert "# TYPE nvpair_anti_entropy_records_in_total counter" in text.splitlines()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_managers_counts_do_not_fall_when_it_restarts(pair: list[Node]) -> None:
    a, b = pair
    b_id = await b.node_id()
    counts = {  # sample name -> labels: each counted by the workload manager child
        "nvpair_relay_events_received_total": {"source": "local"},
        "nvpair_relay_events_accepted_total": {},
        "nvpair_broadcast_events_sent_total": {"peer": b_id},
        "nvpair_broadcast_batches_sent_total": {"peer": b_id},
    }
    families, _ = await scrape(a)
    before = {name: found(families, name, **labels) for name, labels in counts.items()}
    assert all(v and v[0] > 0 for v in before.values()), before  # the requests above
    manager = (await a.get("/healthz"))["manager"]
    os.kill(manager["pid"], signal.SIGKILL)

    async def restarted() -> bool:  # the new child answers, and knows its peer b
        families, _ = await scrape(a)
        return found(families, "nvpair_manager_restarts_total") == [1] and bool(
            found(families, "nvpair_broadcast_queue_depth", peer=b_id)
        )

    await eventually(restarted, "a's workload manager restarted and answering")
    families, _ = await scrape(a)
    after = {name: found(families, name, **labels) for name, labels in counts.items()}
    for name, value_before in before.items():
        assert len(after[name]) == 1, (name, after)
        assert after[name][0] >= value_before[0], (name, before, after)


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


def test_the_dashboard_takes_rates_of_counters_and_reads_gauges_as_they_are() -> None:
    rows = doc_rows()
    for expr in dashboard_exprs():
        rated = set(RATED.findall(expr))
        for name in NAME.findall(expr):
            assert name not in DEPRECATED, (name, expr)  # the counters, not the old gauges
            kind = rows[name.removesuffix("_bucket")][0]  # a histogram's buckets count
            counts = kind == "counter" or name.endswith("_bucket")
            assert (name in rated) == counts, (name, kind, expr)


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
    wanted_titles = ("latency", "first token", "tokens/s per model", "per key", "wait line")
    for wanted in (*wanted_titles, "manager restarts", "anti-entropy"):
        assert wanted in titles


def test_series_made_ahead_follow_what_the_member_knows_within_a_bound() -> None:
    models = {"m1", "m2", "m3"}
    scopes: dict[str, frozenset[str] | None] = {"k1": None, "k2": frozenset({"m2"})}
    usage = UsageMetrics(zero_pairs=5)
    usage.follow(lambda: (models, scopes))

    def pairs() -> set[tuple[str, str]]:
        (family,) = usage.requests.collect()
        outcomes: dict[tuple[str, str], set[str]] = {}
        for s in family.samples:
            if s.name.endswith("_total"):
                outcomes.setdefault((s.labels["model"], s.labels["key"]), set()).add(
                    s.labels["outcome"]
                )
        assert all(o == {"completed", "failed", "cancelled"} for o in outcomes.values())
        return set(outcomes)

    def timed() -> set[str]:
        (family,) = usage.duration.collect()
        return {s.labels["model"] for s in family.samples}

    # Models in order, `other` last; a scoped key only with its models. The fifth pair
    # fills the bound: ("other", "k2") starts with its first request instead.
    assert pairs() == {("m1", "k1"), ("m2", "k1"), ("m2", "k2"), ("m3", "k1"), (OTHER, "k1")}
    assert timed() == {"m1", "m2", "m3", OTHER}
    # k1 revoked, m3 gone: their series go; the places they freed take what is known.
    scopes.pop("k1")
    models.discard("m3")
    usage.sync()
    assert pairs() == {("m2", "k2"), (OTHER, "k2")}
    assert timed() == {"m1", "m2", OTHER}
    # A job that ends after its key went (it was in flight) counts, until the next sync.
    meter = Meter()
    meter.finish()
    usage.count(_job("m1", placed=True, requester="k1"), meter)
    assert ("m1", "k1") in pairs()
    usage.sync()
    assert ("m1", "k1") not in pairs()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_keys_series_come_with_it_and_go_when_it_is_revoked(pair: list[Node]) -> None:
    a, b = pair  # after the requests above: from here on the facade needs a key
    code, text = await post(a, "/v1/keys", {"name": "team-a"})
    assert code == 201, text
    code, text = await post(a, "/v1/keys", {"name": "scoped", "models": ["elsewhere"]})
    assert code == 201, text
    families, _ = await scrape(a)
    assert zero_series(families, "chat", "team-a")[:5] == [[0.0]] * 5  # requests, tokens
    assert found(families, "nvpair_requests_total", model="chat", key="scoped") == []
    assert found(families, "nvpair_requests_total", model=OTHER, key="scoped") == [0] * 3
    # Every request needs a key now: nothing is `none` any more.
    assert found(families, "nvpair_requests_total", key=NO_KEY) == []

    async def on_b(present: bool) -> bool:  # b learns the keys with a's push
        families, _ = await scrape(b)
        return bool(found(families, "nvpair_tokens_total", key="team-a")) == present

    await eventually(lambda: on_b(True), "team-a's series on b")
    code, text = await post(a, "/v1/keys/team-a/revoke", {})
    assert code == 200, text
    families, _ = await scrape(a)
    assert found(families, "nvpair_requests_total", key="team-a") == []
    assert found(families, "nvpair_tokens_total", key="team-a") == []
    await eventually(lambda: on_b(False), "team-a's series gone from b")


@pytest.mark.asyncio(loop_scope="module")
async def test_an_undeployed_models_series_go(pair: list[Node]) -> None:
    a = pair[0]  # the last test of the module: the deployment goes

    async def chat_series(node: Node) -> int:
        families, _ = await scrape(node)
        return sum(
            1 for f in families.values() for s in f.samples if s.labels.get("model") == "chat"
        )

    assert await chat_series(a) > 0
    code, text = await post(a, "/v1/deployments/chat/undeploy", {})
    assert code == 200, text

    async def gone() -> bool:
        return all([await chat_series(node) == 0 for node in pair])

    await eventually(gone, "chat's series gone from a and b")
