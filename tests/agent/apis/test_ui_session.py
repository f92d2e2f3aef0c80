"""The web page's session and security on a real agent (one per module): refused without the
secret (an HTML page on the page's paths, JSON on the API's), a one-time code that sets the
cookie, the Origin rule for a POST with the cookie, the security headers on every kind of
answer, and the page's static files with no way out of their directory."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie

import aiohttp
import pytest
import pytest_asyncio
from yarl import URL

from agent.apis.page import SECURITY_HEADERS
from agent.app.daemon import Agent
from tests.agent.apis.test_local_api import event, started_solo
from tests.fixtures.owner import owner

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Agent]:
    async with started_solo(tmp_path_factory.mktemp("ui")) as node:
        yield node


async def fetch(
    agent: Agent,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: object = None,
    raw: bool = False,
) -> tuple[int, dict[str, str], str]:
    """(status, headers, text) of one request, no redirect followed, nothing added."""
    url = URL(agent.local_api.url + path, encoded=True) if raw else agent.local_api.url + path
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
        session.request(method, url, headers=headers, json=body, allow_redirects=False) as response,
    ):
        return response.status, dict(response.headers), await response.text()


async def login(agent: Agent) -> str:
    """A fresh session cookie (`nvpair_ui=...`) through a code, as the page gets one."""
    status, _, text = await fetch(agent, "POST", "/v1/ui/link", headers=owner(agent.config.home))
    assert status == 200, text
    link = URL(json.loads(text)["url"])
    status, headers, _ = await fetch(agent, "GET", f"{link.path}?{link.query_string}")
    assert status == 303
    cookie = SimpleCookie(headers["Set-Cookie"])["nvpair_ui"]
    return f"nvpair_ui={cookie.value}"


async def test_without_the_secret_the_page_and_the_api_answer_401(agent: Agent) -> None:
    for path in ("/ui/", "/ui/app.js", "/ui/index.html"):
        status, headers, text = await fetch(agent, "GET", path)
        assert status == 401
        assert headers["Content-Type"].startswith("text/html")
        assert "nvpair ui" in text
        assert agent.node_id not in text
    status, headers, text = await fetch(agent, "GET", "/v1/jobs")
    assert (status, headers["Content-Type"]) == (401, "application/json")
    assert "error" in json.loads(text)
    status, _, _ = await fetch(agent, "GET", "/ui/", headers={"Cookie": "nvpair_ui=forged"})
    assert status == 401
    # The control: the token opens the page, and so does a session.
    status, _, _ = await fetch(agent, "GET", "/ui/", headers=owner(agent.config.home))
    assert status == 200
    cookie = await login(agent)
    for path in ("/ui/", "/v1/jobs", "/v1/nodes"):
        status, _, _ = await fetch(agent, "GET", path, headers={"Cookie": cookie})
        assert status == 200, path


async def test_a_code_works_once_and_sets_a_strict_http_only_cookie(agent: Agent) -> None:
    status, _, text = await fetch(agent, "POST", "/v1/ui/link", headers=owner(agent.config.home))
    link = URL(json.loads(text)["url"])
    assert (link.host, link.port, link.path) == ("127.0.0.1", agent.local_api.port, "/ui/login")
    path = f"/ui/login?{link.query_string}"
    status, headers, _ = await fetch(agent, "GET", path)
    assert (status, headers["Location"]) == (303, "/ui/")
    morsel = SimpleCookie(headers["Set-Cookie"])["nvpair_ui"]
    assert morsel["httponly"]
    assert morsel["samesite"] == "Strict"
    assert morsel["path"] == "/"
    assert len(morsel.value) >= 32
    status, headers, _ = await fetch(agent, "GET", path)  # spent
    assert status == 401
    assert "Set-Cookie" not in headers
    status, _, _ = await fetch(agent, "GET", "/ui/login?code=guessed")
    assert status == 401
    # A session cannot mint itself more: a link needs the token.
    cookie = await login(agent)
    own = {"Cookie": cookie, "Origin": agent.local_api.url}
    status, _, _ = await fetch(agent, "POST", "/v1/ui/link", headers=own)
    assert status == 403


async def test_nvpair_ui_prints_a_link_that_logs_in(agent: Agent) -> None:
    home = agent.config.home
    (home / "agent.json").write_text(json.dumps({"api": agent.local_api.url, "pid": os.getpid()}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "ui",
        env={**os.environ, "NVPAIR_HOME": str(home)}, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    link = URL(out.decode().strip())
    status, _, _ = await fetch(agent, "GET", f"{link.path}?{link.query_string}")
    assert status == 303


async def test_a_post_with_the_cookie_needs_the_pages_own_origin(agent: Agent) -> None:
    cookie = await login(agent)
    body = event(agent, "origin-1", 1, "queued")
    for origin in ("http://evil.example", "null", None):
        headers = {"Cookie": cookie} | ({"Origin": origin} if origin else {})
        status, _, _ = await fetch(agent, "POST", "/v1/jobs/events", headers=headers, body=body)
        assert status == 403, origin
    status, _, text = await fetch(agent, "GET", "/v1/jobs", headers={"Cookie": cookie})
    assert "origin-1" not in text
    # The control: from its own Origin the same call is taken.
    headers = {"Cookie": cookie, "Origin": agent.local_api.url}
    status, _, _ = await fetch(agent, "POST", "/v1/jobs/events", headers=headers, body=body)
    assert status == 202
    status, _, text = await fetch(agent, "GET", "/v1/jobs", headers={"Cookie": cookie})
    assert "origin-1" in text


async def test_every_kind_of_answer_carries_the_security_headers(agent: Agent) -> None:
    token = owner(agent.config.home)
    cases = [
        ("GET", "/v1/jobs", token, 200),
        ("GET", "/v1/jobs?state=lost", token, 400),
        ("GET", "/v1/nowhere", token, 404),
        ("GET", "/v1/jobs", {}, 401),
        ("GET", "/ui/", {}, 401),
        ("GET", "/v1/jobs", {**token, "Host": "evil.example"}, 403),
        ("GET", "/healthz", {}, 200),
        ("GET", "/metrics", {}, 200),
        ("GET", "/ui/login?code=x", {}, 401),
        ("GET", "/ui/app.js", token, 200),
        ("GET", "/v1/jobs/counts", token, 200),
    ]
    for method, path, headers, expected in cases:
        status, answer, _ = await fetch(agent, method, path, headers=headers)
        assert status == expected, path
        for name, value in SECURITY_HEADERS.items():
            assert answer.get(name) == value, (path, name)
        assert "frame-ancestors 'none'" in answer["Content-Security-Policy"]
        cache = "no-cache" if path == "/ui/app.js" else "no-store"
        assert answer["Cache-Control"] == cache, path


async def test_the_page_s_files_and_nothing_else(agent: Agent) -> None:
    token = owner(agent.config.home)
    types = {
        "/ui/": "text/html",
        "/ui/index.html": "text/html",
        "/ui/app.js": "text/javascript",
        "/ui/app.css": "text/css",
    }
    for path, kind in types.items():
        status, headers, text = await fetch(agent, "GET", path, headers=token)
        assert status == 200, path
        assert headers["Content-Type"].startswith(kind), path
        assert text
    outside = [
        "/ui/..%2Fui_routes.py",
        "/ui/%2e%2e%2fdaemon.py",
        "/ui/%2e%2e/daemon.py",
        "/ui/ui_routes.py",
        "/ui/.hidden.js",
        "/ui/..",
        "/ui/x/../../agent.json",
        "/ui",
        "/ui/%00.js",
    ]
    for path in outside:
        status, headers, text = await fetch(agent, "GET", path, headers=token, raw=True)
        assert status == 404, path
        assert "import" not in text, path
