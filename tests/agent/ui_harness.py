"""The page in a real browser, for tests/agent/apis/test_ui_browser.py: logging in with `nvpair
ui`'s one-time link, every request and console error the page makes, the states each job's
row went through (recorded in the page itself, so a transient state is not missed by a
poll), and the page's Nodes view read back as data by the DOM contract (docs/ui.md)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import openai
from aiohttp import web
from playwright.async_api import BrowserContext, ConsoleMessage, Page, Request

from tests.workload_manager.cluster_harness import free_port

from .harness import Node, job_key

__all__ = [
    "BACKGROUND",
    "FETCH",
    "MARKER",
    "UiPage",
    "api_nodes",
    "desired",
    "login_link",
    "origin_of",
    "page_nodes",
    "row_id",
    "running",
    "said",
    "site",
    "stream",
]

LINK: Final = re.compile(r"http://127\.0\.0\.1:\d+/ui/login\?code=[A-Za-z0-9_\-]+")
MARKER: Final = "nvpair-ui-test-marker"  # set once in the document: gone if it reloads
# A request from another page, as a form or an <img> could make it (no CORS preflight).
FETCH: Final = """([url, method]) => fetch(url, {method, mode: 'no-cors', credentials: 'include',
  ...(method === 'POST' ? {headers: {'Content-Type': 'text/plain'}, body: '{"replicas": 1}'} : {}),
}).then(() => 0)"""
BACKGROUND: Final = "() => getComputedStyle(document.body).backgroundColor"

# A MutationObserver in the page: window.__jobStates[jobId] = every state its row showed,
# in order (an attribute record's oldValue is a state it held, even between two polls).
RECORD_STATES: Final = """(marker) => {
  const seen = window.__jobStates = {};
  const push = (id, state) => {
    if (!id || !state) return;
    const list = seen[id] || (seen[id] = []);
    if (list[list.length - 1] !== state) list.push(state);
  };
  const note = (row) => push(row.getAttribute('data-job-id'), row.getAttribute('data-state'));
  const rows = (el) => el.nodeType === 1
    ? [...(el.matches('tr[data-job-id]') ? [el] : []), ...el.querySelectorAll('tr[data-job-id]')]
    : [];
  document.querySelectorAll('tr[data-job-id]').forEach(note);
  new MutationObserver((records) => {
    const touched = new Set();
    for (const r of records) {
      if (r.type === 'attributes' && r.target.matches('tr[data-job-id]')) {
        const id = r.target.getAttribute('data-job-id');
        if (r.attributeName === 'data-state') push(id, r.oldValue);
        touched.add(r.target);
      }
      for (const added of r.addedNodes) rows(added).forEach((row) => touched.add(row));
    }
    touched.forEach(note);
  }).observe(document.documentElement, {
    subtree: true, childList: true, attributes: true, attributeOldValue: true,
    attributeFilter: ['data-state', 'data-job-id'],
  });
  window.__marker = marker;
}"""

READ_NODES: Final = """() => [...document.querySelectorAll('.node[data-node-id]')].map((n) => ({
  id: n.dataset.nodeId,
  reachable: n.dataset.reachable ?? n.querySelector('[data-reachable]')?.dataset.reachable,
  cordoned: n.dataset.cordoned ?? n.querySelector('[data-cordoned]')?.dataset.cordoned,
  release: n.querySelector('.release[data-release]')?.dataset.release,
  gpus: [...n.querySelectorAll('.gpu[data-device-id]')].map((g) => [
    g.dataset.deviceId, g.dataset.memoryUsed, g.dataset.memoryTotal, g.dataset.utilization,
    g.dataset.temperature, g.dataset.health, g.closest('.domain[data-domain-id]')?.dataset.domainId,
  ]),
  replicas: [...n.querySelectorAll('.replica[data-replica-id]')].map((r) => [
    r.dataset.replicaId, r.dataset.state, r.dataset.running, r.dataset.waiting,
  ]),
}))"""


def origin_of(url: str) -> str:
    """`scheme://host:port` of a URL."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def login_link(node: Node) -> str:
    """The one-time link `nvpair ui` prints on `node`."""
    code, out, err = await node.cli("ui")
    assert code == 0, err
    found = LINK.search(out)
    assert found, f"no login link in {out!r}"
    return found.group(0)


@dataclass
class UiPage:
    """One logged-in page and what it did: every URL it asked for, its console errors."""

    context: BrowserContext
    page: Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @classmethod
    async def open(cls, context: BrowserContext, link: str) -> UiPage:
        """Open `link` in a new page of `context`, then start recording in the page."""
        page = await context.new_page()
        opened = cls(context, page)

        def on_request(request: Request) -> None:
            opened.requests.append(request.url)

        def on_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                opened.errors.append(message.text)

        page.on("request", on_request)
        page.on("console", on_console)
        page.on("pageerror", lambda exc: opened.errors.append(f"uncaught: {exc}"))
        response = await page.goto(link)
        assert response is not None
        assert response.status == 200, await response.text()
        assert urlsplit(page.url).path == "/ui/", page.url  # the login's 303
        policy = response.headers.get("content-security-policy", "")
        assert "script-src 'self'" in policy, policy  # what the browser then enforces
        assert "frame-ancestors 'none'" in policy, policy
        await page.evaluate(RECORD_STATES, MARKER)
        return opened

    async def marker(self) -> Any:
        """The marker set at login: still there while the document was never reloaded."""
        return await self.page.evaluate("() => window.__marker")

    async def job_states(self) -> dict[str, list[str]]:
        """Every state each job's row showed since login, in order."""
        states: dict[str, list[str]] = await self.page.evaluate("() => window.__jobStates")
        return states

    async def show(self, view: str) -> None:
        """Click the navigation button of `view`."""
        await self.page.click(f"[data-view={view}]")


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


async def page_nodes(page: Page) -> dict[str, Any]:
    """The Nodes view as data: node id -> flags, GPUs and replicas, as the DOM shows them."""
    shown = await page.evaluate(READ_NODES)
    return {
        n["id"]: {
            "reachable": n["reachable"],
            "cordoned": n["cordoned"],
            "release": n["release"],
            "gpus": {
                g[0]: ([_number(v) for v in g[1:5]], g[5], g[6])
                for g in n["gpus"]  # (used, total, utilisation, temperature), health, domain
            },
            "replicas": {r[0]: (r[1], _number(r[2]), _number(r[3])) for r in n["replicas"]},
        }
        for n in shown
    }


async def api_nodes(node: Node) -> dict[str, Any]:
    """What `page_nodes` must show, from the member's `/v1/nodes`."""
    return {
        n["nodeId"]: {
            "reachable": "true" if n["reachable"] else "false",
            "cordoned": "true" if n["cordoned"] else "false",
            "release": n["release"],  # each member's release (docs/upgrade.md)
            "gpus": {
                d["id"]: (
                    [
                        float(d["memoryUsed"]),
                        float(d["memoryTotal"]),
                        float(d["utilization"]),
                        float(d["temperatureC"]),
                    ],
                    d["health"],
                    d["domainId"],
                )
                for d in n["devices"]
            },
            "replicas": {
                r["id"]: (r["state"], float(r["running"]), float(r["waiting"]))
                for r in n["replicas"]
            },
        }
        for n in await node.get("/v1/nodes")
    }


@asynccontextmanager
async def site(html: str, headers: Mapping[str, str] | None = None) -> AsyncIterator[str]:
    """A little web server of its own on 127.0.0.1 (another origin than any agent's),
    answering `html` (with `headers`) at `/`; its URL."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html", headers=headers)

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def said() -> list[Any]:
    """The messages of every request: two words (two prompt tokens to the mock engine)."""
    return [{"role": "user", "content": "hello there"}]


async def stream(oa: openai.AsyncOpenAI, tokens: int) -> list[str]:
    """A streamed chat answer of `tokens` tokens; its pieces."""
    answer = await oa.chat.completions.create(
        model="chat", messages=said(), max_tokens=tokens, stream=True
    )
    pieces = []
    async for chunk in answer:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    return pieces


async def running(node: Node, count: int) -> bool:
    """Whether `node` lists at least `count` chat jobs running."""
    jobs = [j for j in await node.jobs() if j["state"] == "running" and j["model"] == "chat"]
    return len(jobs) >= count


async def desired(node: Node, name: str) -> int:
    """The replicas `name` is declared with, in `node`'s view."""
    (declared,) = [d for d in await node.get("/v1/deployments") if d["name"] == name]
    return int(declared["replicas"])


def row_id(job: dict[str, Any]) -> str:
    """The job's `data-job-id` on the page: origin/runId/id."""
    return "/".join(job_key(job))
