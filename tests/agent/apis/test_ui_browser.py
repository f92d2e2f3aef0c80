"""The page in a real browser (issue 17): three real agents on simulated GPUs with two
deployments of the mock engine; member a's page opened in headless Chromium with `nvpair
ui`'s one-time link; requests sent through member b with the `openai` client. The jobs
appear, run and finish on a's page without a reload, a failed job shows its error, the
Nodes and Cluster views match `/v1/nodes` and `/v1/members`, scaling from the page changes
the replicas, a failed replica shows its log's last lines and undeploying it from the page
takes it away; an elastic deployment's card shows its bounds, its scale-up from zero and
the cold start's seconds; a replica across two members shows its head and its worker (one
group); without the secret the page is refused, a POST from another Origin is
refused, and every request the page makes goes to the agent itself. Screenshots of the
views are written to test-artifacts/ui/ (docs/ui.md, "Testing the page")."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from playwright.async_api import Browser, expect

from tests.fixtures.browser import ARTIFACTS, module_browser

from ..deploy_harness import engine_cluster, post, ready_everywhere, replicas
from ..harness import Node, eventually
from ..ui_harness import (
    BACKGROUND,
    FETCH,
    MARKER,
    UiPage,
    api_nodes,
    desired,
    login_link,
    origin_of,
    page_nodes,
    row_id,
    running,
    said,
    site,
    stream,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SHOTS = ARTIFACTS / "ui"
# a: one NVLink domain of 2; b: 2 x l4 (PCIe); c: two domains of 1.
GPUS = {"a": "h100-80gb-sxm:2", "b": "l4:2", "c": "h100-80gb-sxm:1,h100-80gb-sxm:1"}
KEY = "sk-ui-browser-test"
# chat: two replicas that take one request each (a third waits, queued); 20 tokens a second
# so a 50-token answer runs for 2.5 s. flaky: every request fails (HTTP 500).
CHAT = {"name": "chat", "engine": "mock", "gpus": 1, "replicas": 2, "maxInFlight": 1,
        "args": ["--tokens-per-s", "20"]}  # fmt: skip
FLAKY = {"name": "flaky", "engine": "mock", "gpus": 1, "replicas": 1, "args": ["--fail-rate", "1"]}
# stuck: an engine that loads for ever on a, failed after 2 s with its log's last lines.
LOADING = "import time; print('loading for ever', flush=True); time.sleep(3600)"
STUCK_TEMPLATE = f"""
[templates.stuck]
argv = [{json.dumps(sys.executable)}, "-c", "{LOADING}"]
ready = "/health"
ready_timeout_s = 2
"""
EXPECT_MS = 20_000  # an auto-waiting expect's limit: a busy 2-core machine

browser = module_browser()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("ui")
    keys = f'api_keys = {{ "team-ui" = "{KEY}" }}\n'
    async for started in engine_cluster(root, GPUS, STUCK_TEMPLATE, agent_toml=keys):
        await _deploy(started)
        yield started


async def _deploy(nodes: list[Node]) -> None:
    stuck = {"name": "stuck", "engine": "stuck", "gpus": 0,
             "constraints": {"node": await nodes[0].node_id()}}  # fmt: skip
    for body in (CHAT, FLAKY, stuck):
        code, text = await post(nodes[0], "/v1/deployments", body)
        assert code == 201, text

    async def ready() -> bool:
        return await ready_everywhere(nodes, "chat", 2) and await ready_everywhere(
            nodes, "flaky", 1
        )

    await eventually(ready, "chat and flaky ready everywhere", within_s=60)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ui(browser: Browser, trio: list[Node]) -> AsyncIterator[UiPage]:
    """a's page, logged in once for the module: one document throughout (never reloaded)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    opened = await UiPage.open(context, await login_link(trio[0]))
    try:
        yield opened
    finally:
        await context.close()


def client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)


async def test_the_browser_enforces_a_pages_content_security_policy(browser: Browser) -> None:
    """The last test's check (no console error: a CSP violation is one) is only worth
    something if this browser applies the CSP the agent sends: an inline script on a page
    served with `script-src 'self'` must not run."""
    html = "<!doctype html><p id=p>static</p><script>document.title = 'ran';</script>"
    csp = {"Content-Security-Policy": "default-src 'none'; script-src 'self'"}
    context = await browser.new_context()
    try:
        tab = await context.new_page()
        async with site(html) as url:
            await tab.goto(url)
            assert await tab.title() == "ran"  # control: without the policy it runs
        async with site(html, csp) as url:
            await tab.goto(url)
            await expect(tab.locator("#p")).to_have_text("static")
            assert await tab.title() == ""
    finally:
        await context.close()


async def test_the_page_is_refused_without_the_secret(
    browser: Browser, ui: UiPage, trio: list[Node]
) -> None:
    a = trio[0]
    # Control: the logged-in page holds its session cookie, HttpOnly and SameSite=Strict.
    (cookie,) = [c for c in await ui.context.cookies() if c["name"] == "nvpair_ui"]
    assert cookie["httpOnly"], cookie
    assert cookie["sameSite"] == "Strict", cookie
    assert (await ui.context.request.get(a.api + "/v1/nodes")).status == 200
    secrets = [n["nodeId"] for n in await a.get("/v1/nodes")] + ["chat", "flaky"]
    context = await browser.new_context()  # no cookie, no token
    try:
        tab = await context.new_page()
        for path in ("/ui/", "/ui/app.js"):
            answer = await tab.goto(a.api + path)
            assert answer is not None
            assert answer.status == 401, path
            body = await answer.text()
            assert "nvpair ui" in body
            assert not any(s in body for s in secrets), body
        assert (await context.request.get(a.api + "/v1/nodes")).status == 401
        assert (await context.request.get(a.api + "/v1/jobs")).status == 401
        # A guessed code, and the module's link again (spent): neither logs in.
        for link in (a.api + "/ui/login?code=guessed", await _spent_link(a, browser)):
            await tab.goto(link)
            assert (await context.request.get(a.api + "/v1/nodes")).status == 401, link
        assert not [c for c in await context.cookies() if c["name"] == "nvpair_ui"]
    finally:
        await context.close()


async def _spent_link(a: Node, browser: Browser) -> str:
    """A link used once already (in a context of its own)."""
    link = await login_link(a)
    context = await browser.new_context()
    try:
        assert (await (await context.new_page()).goto(link)) is not None
        assert (await context.request.get(a.api + "/v1/nodes")).status == 200  # control
    finally:
        await context.close()
    return link


async def test_jobs_appear_run_and_finish_without_a_reload(ui: UiPage, trio: list[Node]) -> None:
    a, b, _ = trio
    await ui.show("jobs")
    await expect(ui.page.locator("#conn")).to_contain_text("live", timeout=EXPECT_MS)
    before = await a.job_keys()
    async with client(b) as oa:
        # Two long answers fill chat's two replicas (one request each); a third waits.
        long = [asyncio.create_task(stream(oa, 50)) for _ in range(2)]
        await eventually(lambda: running(b, 2), "b runs two chat jobs")
        short = asyncio.create_task(
            oa.chat.completions.create(model="chat", messages=said(), max_tokens=2)
        )
        with pytest.raises(openai.InternalServerError):
            await oa.chat.completions.create(model="flaky", messages=said(), max_tokens=2)
        assert [len(t) for t in await asyncio.gather(*long)] == [50, 50]
        assert (await short).choices[0].message.content
    jobs = await a.get_settled_jobs(4, since=before)
    by_state = {j["state"]: j for j in jobs}
    failed = by_state["failed"]
    for job in jobs:
        row = ui.page.locator(f'#jobs tr[data-job-id="{row_id(job)}"]')
        await expect(row).to_have_attribute("data-state", job["state"], timeout=EXPECT_MS)
        await expect(row.locator(".model")).to_have_text(job["model"])
        await expect(row.locator(".state")).to_contain_text(re.compile(job["state"], re.I))
        await expect(row.locator(".requester")).to_contain_text("team-ui")
    row = ui.page.locator(f'#jobs tr[data-job-id="{row_id(failed)}"] .error')
    await expect(row).to_contain_text("engine returned HTTP 5xx")
    # Each row showed its states live, in one document: a long job (2.5 s) was seen running
    # and the third queued behind the two long ones, each before it finished.
    seen = await ui.job_states()
    assert await ui.marker() == MARKER  # never reloaded
    chat = [j for j in jobs if j["model"] == "chat"]
    ran = [seen.get(row_id(j), []) for j in chat]
    assert all(states[-1] == "completed" for states in ran), seen
    assert any("running" in states[:-1] for states in ran), seen
    assert any("queued" in states[:-1] for states in ran), seen
    await _counts_shown(ui, await a.get("/v1/jobs/counts"))
    await ui.page.screenshot(path=SHOTS / "jobs.png", full_page=True)


async def test_jobs_filter_by_model_state_and_requester(ui: UiPage, trio: list[Node]) -> None:
    page = ui.page
    rows = page.locator("#jobs tr[data-job-id]")
    await page.fill("#filter-model", "flaky")
    await expect(rows).to_have_count(1, timeout=EXPECT_MS)
    await expect(rows.first).to_have_attribute("data-state", "failed")
    await page.fill("#filter-model", "")
    await page.select_option("#filter-state", "completed")
    await expect(rows).to_have_count(3, timeout=EXPECT_MS)
    await page.select_option("#filter-state", "")
    await page.fill("#filter-requester", "nobody")
    await expect(rows).to_have_count(0, timeout=EXPECT_MS)
    await page.fill("#filter-requester", "team-ui")
    await expect(rows).to_have_count(4, timeout=EXPECT_MS)
    await page.fill("#filter-requester", "")
    await _counts_shown(ui, await trio[0].get("/v1/jobs/counts"))


async def test_nodes_and_members_match_the_api(ui: UiPage, trio: list[Node]) -> None:
    a = trio[0]
    await ui.show("nodes")
    shown: dict[str, Any] = {}
    wanted: dict[str, Any] = {}

    async def same() -> bool:
        nonlocal shown, wanted
        shown, wanted = await page_nodes(ui.page), await api_nodes(a)
        return shown == wanted

    try:
        await eventually(same, "the Nodes view shows what /v1/nodes says")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\npage: {shown}\napi:  {wanted}") from None
    assert len(shown) == 3
    assert sum(len(n["gpus"]) for n in shown.values()) == 6
    for node in await a.get("/v1/nodes"):  # GPUs drawn in their topology domains
        for domain in node["domains"]:
            group = ui.page.locator(f'.domain[data-domain-id="{domain["id"]}"] .gpu')
            await expect(group).to_have_count(len(domain["devices"]))
    await ui.page.screenshot(path=SHOTS / "nodes.png", full_page=True)
    await ui.show("cluster")
    members = await a.get("/v1/members")
    cards = ui.page.locator(".member[data-node-id]")
    await expect(cards).to_have_count(len(members), timeout=EXPECT_MS)
    for member in members:
        card = ui.page.locator(f'.member[data-node-id="{member["nodeId"]}"]')
        await expect(card).to_contain_text(member["name"])
        await expect(card).to_contain_text(member["pin"][:8])
    await ui.page.screenshot(path=SHOTS / "cluster.png", full_page=True)


async def test_scaling_from_the_page_changes_the_replicas(ui: UiPage, trio: list[Node]) -> None:
    await ui.show("deployments")
    card = ui.page.locator('.deployment[data-name="chat"]')
    await expect(card).to_have_attribute("data-ready", "2", timeout=EXPECT_MS)
    await card.locator("input.replicas").fill("3")
    await card.locator("button.scale").click()
    await expect(card).to_have_attribute("data-desired", "3", timeout=EXPECT_MS)
    await expect(card).to_have_attribute("data-ready", "3", timeout=60_000)
    assert await desired(trio[0], "chat") == 3
    await eventually(lambda: ready_everywhere(trio, "chat", 3), "three ready chat replicas")
    ids = {r["id"] for r in await replicas(trio[0], "chat")}
    await ui.show("nodes")
    for rid in ids:  # the new replica is on the Nodes view too, without a reload
        shown = ui.page.locator(f'.replica[data-replica-id="{rid}"]')
        await expect(shown).to_have_attribute("data-state", "ready", timeout=EXPECT_MS)
    await ui.show("deployments")
    # The failed replica on a (the page's own node) shows its engine log's last lines.
    stuck = ui.page.locator('.deployment[data-name="stuck"]')
    await expect(stuck.locator(".log")).to_contain_text("loading for ever", timeout=EXPECT_MS)
    await ui.page.screenshot(path=SHOTS / "deployments.png", full_page=True)
    await stuck.locator("button.undeploy").click()  # asks once more
    assert "stuck" in [d["name"] for d in await trio[0].get("/v1/deployments")]
    await stuck.locator("button.undeploy-confirm").click()
    await expect(stuck).to_have_count(0, timeout=EXPECT_MS)
    assert "stuck" not in [d["name"] for d in await trio[0].get("/v1/deployments")]


async def test_an_elastic_deployment_shows_its_bounds_scale_up_and_cold_start(
    ui: UiPage, trio: list[Node]
) -> None:
    a, b, _ = trio
    lazy = {"name": "lazy", "engine": "mock", "gpus": 0, "minReplicas": 0, "maxReplicas": 1,
            "scaleDownAfterS": 600, "idleToZeroS": 600}  # fmt: skip
    code, text = await post(a, "/v1/deployments", lazy)
    assert code == 201, text
    await ui.show("deployments")
    card = ui.page.locator('.deployment[data-name="lazy"]')
    await expect(card.locator(".bounds")).to_contain_text("0 to 1 replica(s)", timeout=EXPECT_MS)
    await expect(card.locator(".scale-event")).to_have_count(0)  # nothing done yet
    asker = client(b)

    async def listed() -> bool:
        return "lazy" in {m.id async for m in asker.models.list()}

    try:
        await eventually(listed, "b lists lazy at zero")
        answer = await asker.chat.completions.create(
            model="lazy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    finally:
        await asker.close()
    assert answer.model == "lazy"
    up = card.locator('.scale-event[data-kind="scale-up"]')
    await expect(up).to_contain_text("0 → 1 (waiting)", timeout=EXPECT_MS)
    cold = card.locator('.scale-event[data-kind="cold-start"]')
    await expect(cold).to_contain_text(
        re.compile(r"a replica ready in \d+\.\d s"), timeout=EXPECT_MS
    )
    (told,) = [e for e in await a.get("/v1/deployments/events?deployment=lazy")
               if e["kind"] == "cold-start"]  # fmt: skip
    assert f"{told['seconds']:.1f} s" in (await cold.text_content() or "")
    code, _, err = await a.cli("undeploy", "lazy")
    assert code == 0, err


async def test_a_replica_across_members_shows_its_head_and_worker(
    ui: UiPage, trio: list[Node]
) -> None:
    # Issue 32: the page shows each part of a replica that spans members.
    a = trio[0]
    wide = {"name": "wide", "engine": "mock", "source": "wide", "gpus": 0, "nodes": 2}
    code, text = await post(a, "/v1/deployments", wide)
    assert code == 201, text
    await ui.show("deployments")
    card = ui.page.locator('.deployment[data-name="wide"]')
    rows = card.locator(".replica-row")
    await expect(rows).to_have_count(2, timeout=EXPECT_MS)
    await expect(card.locator('.replica-row[data-state="ready"]')).to_have_count(2, timeout=60_000)
    parts = sorted([await cell.text_content() or "" for cell in await rows.locator(".part").all()])
    assert parts == ["head 1/2", "worker 2/2"]
    group = {r["group"] for r in await replicas(a, "wide")}
    assert {
        await cell.get_attribute("title") for cell in await rows.locator(".part").all()
    } == group
    code, _, err = await a.cli("undeploy", "wide")
    assert code == 0, err


async def test_artifacts_and_where_they_are_show_without_a_reload(
    ui: UiPage, trio: list[Node], tmp_path: Path
) -> None:
    _, b, _ = trio
    weights = tmp_path / "page-weights.bin"
    weights.write_bytes(os.urandom(256 * 1024))
    code, out, err = await b.cli("artifact", "add", str(weights), "--name", "page-w")
    assert code == 0, err
    digest = out.split()[2]
    await ui.show("deployments")
    row = ui.page.locator('.artifact[data-name="page-w"]')
    await expect(row).to_have_attribute("data-here", "absent", timeout=EXPECT_MS)  # not on a
    await expect(row).to_contain_text(digest[:19])
    await expect(row.locator(".members")).to_contain_text("b: resident", timeout=EXPECT_MS)
    code, _, err = await trio[0].cli("artifact", "fetch", "page-w", "--wait")
    assert code == 0, err
    await expect(row).to_have_attribute("data-here", "resident", timeout=EXPECT_MS)
    await expect(row.locator(".members")).to_contain_text("a: resident", timeout=EXPECT_MS)


async def test_a_post_from_another_origin_is_refused(ui: UiPage, trio: list[Node]) -> None:
    a = trio[0]
    scale = a.api + "/v1/deployments/chat/scale"
    now = await desired(a, "chat")
    (cookie,) = [c["value"] for c in await ui.context.cookies() if c["name"] == "nvpair_ui"]
    # A page on another port of 127.0.0.1 is the same site: SameSite=Strict still sends the
    # cookie, so only the Origin check stands between it and the API.
    other = await ui.context.new_page()
    try:
        async with site("<!doctype html><title>elsewhere</title>") as elsewhere:
            await other.goto(elsewhere)
            # The other page's GET of the API comes back 200 (opaque to it): its cookie went
            # along. Its POST, with that same cookie, is refused for its Origin.
            for url, method, status in ((a.api + "/v1/nodes", "GET", 200), (scale, "POST", 403)):
                async with other.expect_response(url) as answer:
                    await other.evaluate(FETCH, [url, method])
                assert (await answer.value).status == status, (method, url)
    finally:
        await other.close()
    async with aiohttp.ClientSession() as session:
        for origin, status in (("http://evil.example", 403), (None, 403), (a.api, 200)):
            headers = {"Cookie": f"nvpair_ui={cookie}"} | ({"Origin": origin} if origin else {})
            body = {"replicas": now if status == 200 else 1}  # the control changes nothing
            async with session.post(scale, json=body, headers=headers) as r:
                assert r.status == status, (origin, await r.text())
    assert await desired(a, "chat") == now  # the refused POSTs asked for 1


async def test_usage_view_draws_the_agents_own_series(ui: UiPage, trio: list[Node]) -> None:
    a = trio[0]
    async with client(a) as oa:  # usage is kept on the origin: a few through a
        await oa.chat.completions.create(model="chat", messages=said(), max_tokens=3)
        assert len(await stream(oa, 5)) == 5  # streamed: it has a time to first token
    totals: dict[str, list[int]] = {}
    ttft: dict[str, Any] = {}

    async def both_counted() -> bool:
        nonlocal totals, ttft
        series = await a.get("/v1/usage/series?window=3600")
        ttft = series["ttftMs"]
        totals = {
            name: [sum(got[k]) for k in ("requests", "promptTokens", "completionTokens")]
            for group in ("models", "keys")
            for name, got in series[group].items()
        }
        return totals.get("chat", [0])[0] == 2

    await eventually(both_counted, "a's usage series counts its two requests")
    assert totals == {"chat": [2, 4, 8], "team-ui": [2, 4, 8]}  # "hello there": 2 words
    assert ttft["p50"] is not None, ttft
    await ui.show("usage")
    for series_name in ("requests", "tokens", "ttft", "latency"):
        await expect(ui.page.locator(f'svg.chart[data-series="{series_name}"]')).to_be_visible()
    view = ui.page.locator("section#view-usage")
    for name, (requests, prompt, completion) in totals.items():  # a row each, as the API says
        cells = view.locator("tr", has_text=name).locator("td")
        expected = [name, str(requests), str(prompt), str(completion)]
        await expect(cells).to_have_text(expected, timeout=EXPECT_MS)
    await ui.page.screenshot(path=SHOTS / "usage.png", full_page=True)


async def test_a_narrow_dark_window(ui: UiPage, trio: list[Node]) -> None:
    """360 px wide, dark: no view is wider than the window (tables scroll in their box),
    and the colours follow `prefers-color-scheme`."""
    narrow = await ui.context.new_page()  # the same session
    try:
        await narrow.set_viewport_size({"width": 360, "height": 740})
        await narrow.goto(trio[0].api + "/ui/")
        backgrounds = []
        for scheme in ("light", "dark"):
            await narrow.emulate_media(color_scheme=scheme)
            backgrounds.append(await narrow.evaluate(BACKGROUND))
        assert backgrounds[0] != backgrounds[1], backgrounds
        for view in ("jobs", "nodes", "deployments", "usage", "cluster"):
            await narrow.click(f"[data-view={view}]")
            await expect(narrow.locator(f"section#view-{view}")).to_be_visible()
            width = await narrow.evaluate("() => document.documentElement.scrollWidth")
            assert width <= 360, (view, width)
        await narrow.click("[data-view=jobs]")
        await narrow.screenshot(path=SHOTS / "jobs-360-dark.png", full_page=True)
    finally:
        await narrow.close()


async def test_every_request_went_to_the_agent_and_the_page_never_reloaded(
    ui: UiPage, trio: list[Node]
) -> None:
    assert await ui.marker() == MARKER
    assert ui.requests, "the page made no request at all"
    own = origin_of(trio[0].api)
    elsewhere = [u for u in ui.requests if not u.startswith("data:") and origin_of(u) != own]
    assert not elsewhere, elsewhere
    assert not ui.errors, ui.errors  # a CSP violation is a console error


async def _counts_shown(ui: UiPage, counts: dict[str, Any]) -> None:
    """The counts per state on the Jobs view come to what `/v1/jobs/counts` says."""
    assert counts["byState"], counts
    for state, count in counts["byState"].items():
        shown = ui.page.locator(f'#job-counts [data-state="{state}"]')
        await expect(shown).to_contain_text(re.compile(rf"\b{count}\b"), timeout=EXPECT_MS)
