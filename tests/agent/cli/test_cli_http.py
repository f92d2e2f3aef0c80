"""The CLI's HTTP helper against a real HTTP server: finding the agent (none, stale, live),
answers, refusals and silence as one-line `CliError`s, and `main` turning them into exit 1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from agent.cli import calls as cli_http
from agent.cli.calls import CliError
from agent.cli.main import main
from netkit.sites import start_site

TOKEN = "s3cret-token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NVPAIR_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
async def api() -> AsyncIterator[str]:
    """A stand-in for the agent's local API: echoes, refuses, answers non-JSON."""

    async def nodes(request: web.Request) -> web.Response:
        return web.json_response([{"nodeId": "nod_x"}])

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json()})

    async def conflict(request: web.Request) -> web.Response:
        return web.json_response({"error": "a drain of nod_x is running"}, status=409)

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="<html>not json</html>")

    @web.middleware
    async def owner_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        # As the agent does: its token, or a 401 (`write_state` writes it as the agent would).
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "no token"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[owner_only])
    app.router.add_get("/v1/nodes", nodes)
    app.router.add_post("/v1/echo", echo)
    app.router.add_post("/v1/conflict", conflict)
    app.router.add_get("/v1/plain", plain)
    runner = web.AppRunner(app)
    port = await start_site(runner, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def write_state(home: Path, api: str, pid: int) -> None:
    (home / "agent.json").write_text(json.dumps({"api": api, "pid": pid, "nodeId": "nod_x"}))
    (home / "local-api.token").write_text(TOKEN + "\n")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_no_agent_json_names_the_home(home: Path) -> None:
    with pytest.raises(CliError, match=re.escape(f"no agent is running for NVPAIR_HOME={home}")):
        cli_http.agent_url()


def test_a_stale_agent_json_names_its_pid(home: Path) -> None:
    pid = dead_pid()
    write_state(home, "http://127.0.0.1:1", pid)
    with pytest.raises(CliError) as caught:
        cli_http.agent_url()
    assert str(caught.value) == f"no agent is running (stale agent.json from pid {pid})"
    # The control: the same file naming a live process is taken.
    write_state(home, "http://127.0.0.1:1/", os.getpid())
    assert cli_http.agent_url() == "http://127.0.0.1:1"


@pytest.mark.parametrize("content", ["{not json", '["api"]', '{"pid": 1}'])
def test_a_garbled_agent_json_is_a_clear_error(home: Path, content: str) -> None:
    (home / "agent.json").write_text(content)
    with pytest.raises(CliError, match=r"agent\.json"):
        cli_http.agent_url()


async def test_get_and_post_answer_with_the_decoded_json(home: Path, api: str) -> None:
    write_state(home, api, os.getpid())
    assert await asyncio.to_thread(cli_http.get, "/v1/nodes") == [{"nodeId": "nod_x"}]
    answer = await asyncio.to_thread(cli_http.post, "/v1/echo", {"kind": "cordon"})
    assert answer == {"got": {"kind": "cordon"}}
    # The token is read at each call (a restarted agent issued a new one); none is a refusal.
    (home / "local-api.token").write_text("an-old-token\n")
    with pytest.raises(CliError, match=r"refused \(401\)"):
        await asyncio.to_thread(cli_http.get, "/v1/nodes")
    (home / "local-api.token").unlink()
    with pytest.raises(CliError, match=r"cannot read the agent's token .*local-api\.token"):
        await asyncio.to_thread(cli_http.get, "/v1/nodes")


async def test_a_refusal_says_who_refused_and_why(home: Path, api: str) -> None:
    write_state(home, api, os.getpid())
    with pytest.raises(CliError) as caught:
        await asyncio.to_thread(cli_http.post, "/v1/conflict", {})
    assert str(caught.value) == "the agent refused (409): a drain of nod_x is running"
    with pytest.raises(CliError, match="not JSON"):
        await asyncio.to_thread(cli_http.get, "/v1/plain")


def test_silence_says_the_agent_does_not_answer(home: Path) -> None:
    write_state(home, f"http://127.0.0.1:{closed_port()}", os.getpid())
    with pytest.raises(CliError, match=r"the agent does not answer at http://127\.0\.0\.1:"):
        cli_http.get("/v1/nodes")


def test_main_prints_one_line_and_exits_1(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_state(home, "http://127.0.0.1:1", dead_pid())
    assert main(["nodes"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("nvpair: no agent is running (stale agent.json from pid ")
