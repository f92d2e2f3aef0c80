"""The local API through its port, on one agent composed in this process (its workload
manager is the one child process): every route, and every kind of bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.app.daemon import Agent
from agent.cli import agent as agent_cli
from agent.cli.main import main as cli_main
from agent.config import AgentConfig, load_config
from certs import ClusterDir
from tests.fixtures.owner import owner
from tests.fixtures.waiting import eventually
from workload_manager.workload import Workload


def solo_config(home: Path) -> AgentConfig:
    """A cluster of one in `home`, every port picked by the kernel, two simulated GPUs."""
    ClusterDir(home / "cluster").init("lab", "solo", ["127.0.0.1"])
    overrides = {"name": "solo", "simulate_gpus": "l4:2", "facade_bind": "127.0.0.1"}
    ports = {f"{kind}_port": 0 for kind in ("manager", "node", "api", "facade")}
    return load_config(home, overrides | ports)


@contextlib.asynccontextmanager
async def started_solo(home: Path) -> AsyncIterator[Agent]:
    """`solo_config(home)`'s agent, started in this process on 127.0.0.1 (for a module's
    fixture: NVPAIR_BIND is set only while it starts), stopped on exit."""
    bind = os.environ.get("NVPAIR_BIND")
    os.environ["NVPAIR_BIND"] = "127.0.0.1"
    try:
        node = Agent(solo_config(home))
        await node.start()
    finally:
        if bind is None:
            del os.environ["NVPAIR_BIND"]
        else:
            os.environ["NVPAIR_BIND"] = bind
    try:
        yield node
    finally:
        await node.aclose()


@pytest.fixture
async def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Agent]:
    monkeypatch.setenv("NVPAIR_BIND", "127.0.0.1")
    node = Agent(solo_config(tmp_path))
    await node.start()
    yield node
    await node.aclose()


async def call(
    agent: Agent, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One request as the agent's owner (its token; raw bytes sent as JSON), `headers` on top."""
    data = body if isinstance(body, bytes) else None
    json_type = {"Content-Type": "application/json"} if data is not None else {}
    sent = owner(agent.config.home) | json_type
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            agent.local_api.url + path,
            json=None if data is not None else body,
            data=data,
            headers=sent | (headers or {}),
        ) as response,
    ):
        text = await response.text()
        is_json = response.content_type == "application/json"
        return response.status, (await response.json() if is_json else text)


def event(agent: Agent, wid: str, seq: int, state: str) -> dict[str, Any]:
    method = {"queued": "workload:submitted", "running": "workload:started"}.get(
        state, "workload:completed"
    )
    record = {
        "id": wid, "model": "m", "engine": "vllm", "runId": "run-1", "state": state,
        "originatedFrom": agent.node_id, "createdAt": 1_764_000_000_000 + seq, "seq": seq,
        "startedAt": None, "completedAt": None, "error": None, "requesterId": None,
    }  # fmt: skip
    return {"method": method, "params": {"workloadInfo": record}}


async def test_health_nodes_members_and_metrics(agent: Agent) -> None:
    status, health = await call(agent, "GET", "/healthz")
    assert status == 200
    assert (health["ok"], health["failing"], health["nodeId"]) == (True, [], agent.node_id)
    status, nodes = await call(agent, "GET", "/v1/nodes")
    assert [(n["nodeId"], n["reachable"], len(n["devices"])) for n in nodes] == [
        (agent.node_id, True, 2)
    ]
    status, members = await call(agent, "GET", "/v1/members")
    assert [m["nodeId"] for m in members] == [agent.node_id]
    status, text = await call(agent, "GET", "/metrics")
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "nvpair_jobs",
        "nvpair_gpu_memory_total_bytes",
        "nvpair_manager_restarts",
        "nvpair_manager_dropped_frames",
    } <= names


async def test_events_in_and_the_jobs_list_out(agent: Agent) -> None:
    for wid, seq, state in (("1", 1, "queued"), ("1", 2, "running"), ("2", 1, "queued")):
        status, _ = await call(agent, "POST", "/v1/jobs/events", event(agent, wid, seq, state))
        assert status == 202
    status, jobs = await call(agent, "GET", "/v1/jobs")
    assert status == 200
    assert sorted((j["id"], j["state"]) for j in jobs) == [("1", "running"), ("2", "queued")]
    status, running = await call(agent, "GET", "/v1/jobs?state=running")
    assert [j["id"] for j in running] == ["1"]
    status, limited = await call(agent, "GET", "/v1/jobs?limit=1")
    assert len(limited) == 1


async def test_cordon_through_ops_and_explain_says_why(agent: Agent) -> None:
    status, op = await call(agent, "POST", "/v1/ops", {"kind": "cordon", "target": agent.node_id})
    assert (status, op["kind"], op["target"]) == (200, "cordon", agent.node_id)

    async def succeeded() -> bool:
        ops = (await call(agent, "GET", "/v1/ops"))[1]
        return bool(ops) and ops[0]["phase"] == "succeeded"

    await eventually(succeeded, "the cordon to succeed")
    nodes = (await call(agent, "GET", "/v1/nodes"))[1]
    assert nodes[0]["cordoned"] is True
    status, explained = await call(agent, "GET", "/v1/explain?model=m")
    assert explained["refused"] == [{"nodeId": agent.node_id, "reason": "cordoned"}]


async def test_a_node_cannot_remove_itself(agent: Agent) -> None:
    status, text = await call(agent, "POST", f"/v1/members/{agent.node_id}/remove")
    assert status == 400
    assert "cannot remove itself" in text
    assert [m["nodeId"] for m in (await call(agent, "GET", "/v1/members"))[1]] == [agent.node_id]


async def test_the_whole_jobs_list_through_its_cursor(agent: Agent) -> None:
    for n in range(5):
        status, _ = await call(agent, "POST", "/v1/jobs/events", event(agent, f"j{n}", 1, "queued"))
        assert status == 202
    seen: list[str] = []
    status, page = await call(agent, "GET", "/v1/jobs?page=1&limit=2")
    while True:
        assert status == 200, page
        assert set(page) == {"jobs", "next"}
        seen += [j["id"] for j in page["jobs"]]
        if page["next"] is None:
            break
        status, page = await call(agent, "GET", f"/v1/jobs?limit=2&after={page['next']}")
    assert seen == [f"j{n}" for n in reversed(range(5))]  # each once, newest first
    # Without page=1 or after, the plain list of today.
    assert [j["id"] for j in (await call(agent, "GET", "/v1/jobs?limit=2"))[1]] == ["j4", "j3"]


async def test_a_job_this_node_originated_is_removed(agent: Agent) -> None:
    for wid in ("1", "2"):
        await call(agent, "POST", "/v1/jobs/events", event(agent, wid, 1, "queued"))
    status, answer = await call(agent, "POST", "/v1/jobs/1/remove")
    assert (status, answer["removed"], answer["already"]) == (200, "1", False)
    # Committed by the time of the answer, and it holds: a late upsert does not bring it back.
    assert [j.id for j in await agent.store.jobs()] == ["2"]
    status, _ = await call(agent, "POST", "/v1/jobs/events", event(agent, "1", 2, "running"))
    assert status == 202
    assert [j["id"] for j in (await call(agent, "GET", "/v1/jobs"))[1]] == ["2"]
    status, answer = await call(agent, "POST", "/v1/jobs/1/remove", {})
    assert (status, answer["already"]) == (200, True)  # again: nothing more to do


async def test_a_job_another_node_originated_is_not_removed_here(agent: Agent) -> None:
    theirs = event(agent, "1", 1, "queued")
    theirs["params"]["workloadInfo"]["originatedFrom"] = "nod_someoneelse"
    agent.writer.upsert(msgspec.convert(theirs["params"]["workloadInfo"], Workload))
    status, text = await call(agent, "POST", "/v1/jobs/1/remove")
    assert status == 400
    assert "originated by nod_someoneelse" in text
    body = {"originatedFrom": "nod_someoneelse"}
    assert (await call(agent, "POST", "/v1/jobs/1/remove", body))[0] == 400
    assert (await call(agent, "POST", "/v1/jobs/1/remove", b"[1]"))[0] == 400
    assert (await call(agent, "POST", "/v1/jobs/nothing/remove"))[0] == 404
    assert [j["id"] for j in (await call(agent, "GET", "/v1/jobs"))[1]] == ["1"]  # still there


async def test_the_managers_status(agent: Agent) -> None:
    await call(agent, "POST", "/v1/jobs/events", event(agent, "1", 1, "queued"))
    status, body = await call(agent, "GET", "/v1/manager")
    assert status == 200, body
    assert body["supervisor"]["state"] == "running"
    assert (body["supervisor"]["restarts"], body["supervisor"]["dropped"]) == (0, 0)
    assert body["status"]["counters"]["received_local"] >= 1
    assert body["status"]["broadcast"] == []  # alone: no peer to send to


async def test_a_dead_part_makes_health_not_ok_and_an_event_a_503(agent: Agent) -> None:
    await agent.store.db.close()  # the Jobs writer's next write is a bug: its task dies
    status, text = await call(agent, "POST", "/v1/jobs/events", event(agent, "1", 1, "queued"))
    assert status == 503, text
    status, health = await call(agent, "GET", "/healthz")
    assert status == 503
    assert "jobs-store" in {f["part"] for f in health["failing"]}  # (its readers die too)


async def nvpair(*argv: str) -> int:
    """`nvpair ARGV` in a thread (its HTTP blocks; the agent runs on this loop)."""
    return await asyncio.to_thread(cli_main, list(argv))


async def test_the_jobs_commands_page_and_remove(
    agent: Agent,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("NVPAIR_HOME", str(tmp_path))
    monkeypatch.setattr(agent_cli, "PAGE", 2)
    for n in range(5):
        await call(agent, "POST", "/v1/jobs/events", event(agent, f"j{n}", 1, "queued"))
    capsys.readouterr()
    assert await nvpair("jobs", "--json") == 0
    out, err = capsys.readouterr()
    assert [j["id"] for j in json.loads(out)] == ["j4", "j3"]
    assert "there are more (--all for every one)" in err  # not silently one page
    assert await nvpair("jobs", "--json", "--all") == 0
    out, err = capsys.readouterr()
    assert [j["id"] for j in json.loads(out)] == [f"j{n}" for n in reversed(range(5))]
    assert err == ""
    assert await nvpair("jobs", "remove", "j2") == 0
    out, err = capsys.readouterr()
    assert out == "job j2 removed; the members follow\n"
    assert "j2" not in {j.id for j in await agent.store.jobs()}
    assert await nvpair("jobs", "remove", "j9") == 1
    out, err = capsys.readouterr()
    assert (out, err.count("\n")) == ("", 1)
    assert "no job 'j9'" in err


async def test_the_record_advertises_other_ports_than_the_listening_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVPAIR_BIND", "127.0.0.1")
    ClusterDir(tmp_path / "cluster").init("lab", "solo", ["127.0.0.1"])
    ports = {"manager_port": 0, "node_port": 0, "api_port": 0, "facade_port": 0}
    advertise = "127.0.0.9:24320,24321,24323"  # what a proxy in front of it would listen on
    node = Agent(load_config(tmp_path, {"name": "solo", "advertise": advertise, **ports}))
    await node.start()
    try:
        [record] = (await call(node, "GET", "/v1/nodes"))[1]
        assert record["addresses"] == ["127.0.0.9"]
        assert (record["managerPort"], record["nodePort"], record["facadePort"]) == (
            24320,
            24321,
            24323,
        )
        assert node.facade.port not in (0, 24323)  # it listens where it was told to
    finally:
        await node.aclose()


async def test_health_says_starting_until_the_engines_are_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine whose `/v1/models` answers only when let: until then the agent's ports answer
    # but it does not yet know what the engine serves -- /healthz must not say ok.
    asked, answer = asyncio.Event(), asyncio.Event()

    async def models(request: aiohttp.web.Request) -> aiohttp.web.Response:
        asked.set()
        await answer.wait()
        return aiohttp.web.json_response({"object": "list", "data": [{"id": "slow-m"}]})

    app = aiohttp.web.Application()
    app.router.add_get("/v1/models", models)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    monkeypatch.setenv("NVPAIR_BIND", "127.0.0.1")
    ClusterDir(tmp_path / "cluster").init("lab", "solo", ["127.0.0.1"])
    config = load_config(tmp_path, {"engines": [f"vllm=http://127.0.0.1:{port}"]} | {
        "name": "solo", "simulate_gpus": "l4:2", "facade_bind": "127.0.0.1",
        **{f"{kind}_port": 0 for kind in ("manager", "node", "api", "facade")},
    })  # fmt: skip
    node = Agent(config)
    starting = asyncio.create_task(node.start())
    try:
        await asyncio.wait_for(asked.wait(), 30)
        status, health = await call(node, "GET", "/healthz")
        assert (status, health["ok"]) == (503, False)
        assert [f["part"] for f in health["failing"]] == ["start"]
        answer.set()
        await starting
        status, health = await call(node, "GET", "/healthz")  # the control: ok once started
        assert (status, health["ok"], health["failing"]) == (200, True, [])
        facade = f"http://127.0.0.1:{node.facade.port}/v1/models"
        async with aiohttp.ClientSession() as session, session.get(facade) as listed:
            assert "slow-m" in [m["id"] for m in (await listed.json())["data"]]
    finally:
        answer.set()
        with contextlib.suppress(BaseException):
            await starting
        await node.aclose()
        await runner.cleanup()
