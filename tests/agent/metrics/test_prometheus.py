"""The metrics as an operator's Prometheus reads them (issue 31, item 1).

Debian's real `prometheus` scrapes two real agents every second while they serve: requests
under an API key through b's facade (one streamed) to a deployment of the mock engine, and
requests to a deployment whose engine fails every one. Then, through Prometheus' HTTP API:
every `expr` of the Grafana dashboard (its variables as "All", `$__rate_interval` a
minute) and every query of docs/metrics.md parses and returns data; the dashboard's
variables resolve (`label_values` lists a and b, the models, the key); a burst sent right
after a deployment became ready shows whole in `increase()` (its series were there at zero
before it); and `promtool check metrics` has nothing to say of either agent's `/metrics`.

Without `prometheus` on the PATH the module is skipped, unless NVPAIR_REQUIRE_PROMETHEUS=1
(`.ci/run` installs Debian's and sets it: there a missing one fails)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from tests.workload_manager.cluster_harness import free_port

from ..deploy_harness import engine_cluster, post, ready_everywhere
from ..harness import Node, eventually
from .test_metrics_names import DOC, dashboard_exprs

KEY = "sk-prometheus-test"
SCRAPE_S = 1
ALL = ".*"

if shutil.which("prometheus") is None or shutil.which("promtool") is None:
    if os.environ.get("NVPAIR_REQUIRE_PROMETHEUS") == "1":
        raise RuntimeError("NVPAIR_REQUIRE_PROMETHEUS=1 and no prometheus/promtool on PATH")
    pytest.skip("no prometheus on PATH (apt-get install prometheus)", allow_module_level=True)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Scraped:
    nodes: list[Node]
    url: str  # Prometheus' own

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; the test fails on a query Prometheus refuses."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + "/api/v1/query", params={"query": expr}) as answer,
        ):
            body = await answer.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def label_values(self, label: str, match: str) -> list[str]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": match}) as a,
        ):
            body = await a.json()
        assert body["status"] == "success", body
        values: list[str] = body["data"]
        return values


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def scraped(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scraped]:
    root = tmp_path_factory.mktemp("prometheus")
    keys = f'api_keys = {{ "team-prom" = "{KEY}" }}\n'
    async for nodes in engine_cluster(root / "cluster", {"a": "l4:1", "b": None}, agent_toml=keys):
        await _deploy(nodes)
        async for world in _prometheus(root, nodes):
            await _traffic(nodes[1])
            yield world


async def _deploy(nodes: list[Node]) -> None:
    for body in (
        {"name": "chat", "engine": "mock", "gpus": 0, "args": ["--latency-ms", "20"]},
        {"name": "broken", "engine": "mock", "gpus": 0, "args": ["--fail-rate", "1"]},
    ):
        code, text = await post(nodes[0], "/v1/deployments", body)
        assert code == 201, text
    await eventually(lambda: _all_ready(nodes), "chat and broken ready everywhere", within_s=60)


async def _prometheus(root: Path, nodes: list[Node]) -> AsyncIterator[Scraped]:
    """Debian's prometheus scraping `nodes`' local APIs every second, each as its name."""
    port = free_port()
    config = root / "prometheus.yml"
    targets = "\n".join(
        f"      - targets: ['127.0.0.1:{n.ports['api']}']\n        labels: {{instance: {n.name}}}"
        for n in nodes
    )
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
        f"scrape_configs:\n  - job_name: nvpair\n    static_configs:\n{targets}\n"
    )
    with (root / "prometheus.log").open("wb") as log:
        server = await asyncio.create_subprocess_exec(
            "prometheus", f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=log, stderr=log,
        )  # fmt: skip
    try:
        world = Scraped(nodes, f"http://127.0.0.1:{port}")

        async def both_up() -> bool:
            with contextlib.suppress(aiohttp.ClientError, AssertionError):
                up = await world.query("up")
                return sorted((r["metric"]["instance"], r["value"][1]) for r in up) == [
                    ("a", "1"), ("b", "1"),
                ]  # fmt: skip
            return False

        await eventually(both_up, "prometheus scrapes a and b")
        yield world
    finally:
        server.terminate()
        try:
            async with asyncio.timeout(10):
                await server.wait()
        except TimeoutError:
            server.kill()
            await server.wait()


async def _all_ready(nodes: list[Node]) -> bool:
    return await ready_everywhere(nodes, "chat", 1) and await ready_everywhere(nodes, "broken", 1)


def _client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)


async def _traffic(node: Node) -> None:
    """Requests through `node` under the key: answered, one streamed, and failed."""
    async with _client(node) as client:
        for _ in range(6):
            await client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        stream = await client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert len([chunk async for chunk in stream]) > 1
        for _ in range(3):
            with pytest.raises(openai.APIStatusError):
                await client.chat.completions.create(
                    model="broken", messages=[{"role": "user", "content": "hi"}]
                )


def _grafana(expr: str) -> str:
    """A dashboard expression as Grafana sends it with every variable at "All"."""
    filled = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    return re.sub(r"\$\{?(model|key|instance)\}?", ALL, filled)


def doc_queries() -> list[str]:
    """The queries of docs/metrics.md's "Useful queries": each code span with a call."""
    text = DOC.read_text()
    section = text.split("## Useful queries", 1)[1].split("\n## ", 1)[0]
    spans = re.findall(r"`([^`]+)`", " ".join(section.split()))
    return [s for s in spans if "(" in s or " and " in s]


def alerting(query: str) -> bool:
    """A query that filters by a threshold: data only while something is wrong."""
    return re.search(r"[<>]=? ?\d", query) is not None


async def test_every_dashboard_expression_and_documented_query_returns_data(
    scraped: Scraped,
) -> None:
    exprs = [_grafana(e) for e in dashboard_exprs()]
    queries = [q for q in doc_queries() if not alerting(q)]  # those: the last test
    assert len(exprs) >= 30
    assert len(queries) >= 4  # the control: the doc's list was found

    empty: list[str] = []

    async def all_answer() -> bool:  # once two scrapes hold the traffic
        empty[:] = [e for e in [*exprs, *queries] if not await scraped.query(e)]
        return not empty

    with contextlib.suppress(AssertionError):  # said below: which ones stayed empty
        await eventually(all_answer, "every query returns data", within_s=30)
    assert empty == []


async def test_the_dashboards_variables_resolve(scraped: Scraped) -> None:
    assert await scraped.label_values("instance", "nvpair_jobs") == ["a", "b"]
    models = await scraped.label_values("model", "nvpair_requests_total")
    assert {"chat", "broken"} <= set(models)
    assert "team-prom" in await scraped.label_values("key", "nvpair_requests_total")


async def test_a_burst_right_after_a_deployment_is_ready_shows_whole_in_increase(
    scraped: Scraped,
) -> None:
    a, b = scraped.nodes
    code, text = await post(a, "/v1/deployments", {"name": "fresh", "engine": "mock", "gpus": 0})
    assert code == 201, text
    await eventually(lambda: ready_everywhere(scraped.nodes, "fresh", 1), "fresh ready")
    # b shows fresh's series at 0 from the moment it knows the deployment; Prometheus holds
    # them once it has scraped b since. A burst before that scrape starts the series at its
    # end, which no exporter can help: increase() has no earlier sample. Wait for it.
    series = 'sum(nvpair_requests_total{model="fresh",instance="b"})'

    async def at_zero() -> bool:
        result = await scraped.query(series)
        return bool(result) and float(result[0]["value"][1]) == 0.0

    await eventually(at_zero, "Prometheus holds fresh's series on b, at 0", within_s=20)
    burst = 25
    async with _client(b) as client:
        await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="fresh", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                for _ in range(burst)
            )
        )
    expr = 'sum(increase(nvpair_requests_total{model="fresh",instance="b"}[2m]))'

    async def counted() -> float:
        result = await scraped.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    async def whole() -> bool:  # extrapolated to the window: at least the burst
        return await counted() >= burst

    await eventually(whole, f"increase() counts the burst of {burst}", within_s=20)
    assert await counted() < 2 * burst  # and not something else counted


async def test_promtool_finds_nothing_to_say_of_either_agents_metrics(scraped: Scraped) -> None:
    for node in scraped.nodes:
        async with aiohttp.ClientSession() as session, session.get(node.api + "/metrics") as r:
            text = await r.read()
        promtool = await asyncio.create_subprocess_exec(
            "promtool", "check", "metrics", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        async with asyncio.timeout(30):
            said, _ = await promtool.communicate(text)
        assert (promtool.returncode, said.decode()) == (0, ""), node.name


async def test_the_alerting_queries_fire_when_a_peer_is_away(scraped: Scraped) -> None:
    # Last: it stops b. While b is there nothing falls behind (the control); with b away,
    # a's requests make events a cannot deliver to b, and the documented query fires.
    alerts = [q for q in doc_queries() if alerting(q)]
    assert alerts  # the peer-falling-behind query
    for query in alerts:
        assert await scraped.query(query) == [], query
    a, b = scraped.nodes
    await b.stop()
    async with _client(a) as client:
        for _ in range(3):
            with contextlib.suppress(openai.APIError):  # chat may have run on b
                await client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )

    async def fired() -> bool:
        return all([await scraped.query(q) for q in alerts])

    await eventually(fired, "the alerting queries return data", within_s=30)
