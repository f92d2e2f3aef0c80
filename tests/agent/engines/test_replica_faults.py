"""Replicas through failures (issue 13, Done when), against real agents and real engine
processes: an engine killed with SIGKILL is restarted while the requests sent meanwhile
succeed on the other replica; an agent killed with SIGKILL re-adopts its engine on restart
(the same pid, no second engine); a replica reporting a long queue gets no new requests;
an engine that already runs is adopted as `observed` and never restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ..deploy_harness import alive, engine_cluster, engine_pids, post, replicas
from ..harness import Node, eventually, start_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("replica-faults")
    async for started in engine_cluster(root, {"a": None, "b": None}):
        yield started


async def ready(node: Node, deployment: str, count: int) -> bool:
    seen = await replicas(node, deployment)
    return len(seen) == count and all(r["state"] == "ready" for r in seen)


async def chat(session: aiohttp.ClientSession, node: Node, model: str) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


async def test_a_killed_engine_is_restarted_and_requests_meanwhile_succeed(
    pair: list[Node],
) -> None:
    a, b = pair
    body = {"name": "twin", "engine": "mock", "gpus": 0, "replicas": 2,
            "args": ["--latency-ms", "100"]}  # fmt: skip
    assert (await post(a, "/v1/deployments", body))[0] == 201
    await eventually(lambda: ready(a, "twin", 2), "two ready replicas of twin", within_s=60)
    assert {r["node"] for r in await replicas(a, "twin")} == {"a", "b"}  # spread
    (rid, pid), = engine_pids(b.home).items()  # fmt: skip
    stop = asyncio.Event()
    statuses: list[int] = []

    async def load() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                results = await asyncio.gather(*(chat(session, a, "twin") for _ in range(4)))
                statuses.extend(code for code, _ in results)

    driving = asyncio.create_task(load())
    await eventually(lambda: len(statuses) >= 8, "requests flow")
    os.kill(pid, signal.SIGKILL)

    async def restarted() -> bool:
        now = engine_pids(b.home).get(rid)
        return now is not None and now != pid and await ready(a, "twin", 2)

    await eventually(restarted, "b's engine restarted, ready again", within_s=60)
    sent_during = len(statuses)
    await eventually(lambda: len(statuses) >= sent_during + 8, "requests after the restart")
    stop.set()
    await driving
    assert statuses.count(200) == len(statuses), statuses  # none failed, none reset
    restarts = {r["id"]: r["restarts"] for r in await replicas(b, "twin")}
    assert restarts[rid] >= 1


async def test_an_agent_killed_hard_re_adopts_its_engine(pair: list[Node]) -> None:
    b = pair[1]
    await eventually(lambda: ready(b, "twin", 2), "twin ready")
    before = engine_pids(b.home)
    assert b.proc is not None
    b.proc.kill()  # kill -9: no cleanup at all
    await b.proc.wait()
    assert all(alive(pid) for pid in before.values())  # its engine outlives it
    await b.start()
    await eventually(lambda: ready(b, "twin", 2), "twin ready after b's restart", within_s=60)
    # the same engine process, adopted; no second one for this home
    assert engine_pids(b.home) == before
    assert _engines_of(b.home) == set(before.values())


async def test_a_replica_with_a_long_queue_gets_no_new_requests(pair: list[Node]) -> None:
    a = pair[0]
    body = {"name": "queue", "engine": "mock", "gpus": 0, "replicas": 2,
            "args": ["--max-concurrency", "1", "--latency-ms", "1500"]}  # fmt: skip
    assert (await post(a, "/v1/deployments", body))[0] == 201
    await eventually(lambda: ready(a, "queue", 2), "two ready replicas of queue", within_s=60)
    on_b = next(r for r in await replicas(a, "queue") if r["node"] == "b")
    on_a = next(r for r in await replicas(a, "queue") if r["node"] == "a")
    # Fill b's engine directly (not through nvpair): one running, seven waiting.
    direct = f"http://127.0.0.1:{on_b['port']}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        body_b = {"model": "queue", "messages": [{"role": "user", "content": "x"}]}
        flood = [asyncio.create_task(_post(session, direct, body_b)) for _ in range(8)]

        async def a_sees_the_queue() -> bool:
            # ... in a fresh report: one older than scheduler.replicas.STALE_MS would count
            # as unknown (neutral), which a machine this busy can make it
            # -- and a's own replica's too: one never read counts as the mean of the others
            # (scheduler.replicas), which would make idle a look as busy as b
            seen = {r["id"]: r for r in await replicas(a, "queue")}
            now_ms = time.time() * 1000
            fresh = all(now_ms - seen[r["id"]]["loadAt"] < 2000 for r in (on_a, on_b))
            return bool(seen[on_b["id"]]["waiting"] >= 4 and fresh)

        await eventually(a_sees_the_queue, "a's view shows b's queue")
        served_before = await _requests(on_a["port"])
        results = await asyncio.gather(*(chat(session, a, "queue") for _ in range(4)))
        assert [code for code, _ in results] == [200] * 4
        # All four went to a's replica: counted by the engines themselves.
        assert await _requests(on_a["port"]) - served_before == 4
        for task in flood:
            task.cancel()


async def test_an_engine_already_running_is_observed_never_restarted(pair: list[Node]) -> None:
    a, b = pair
    engine = await start_engine("outside")
    try:
        body = {"name": "outside", "engine": "vllm", "authority": "observed", "url": engine.url,
                "constraints": {"node": "a"}}  # fmt: skip
        assert (await post(b, "/v1/deployments", body))[0] == 201
        await eventually(lambda: ready(b, "outside", 1), "the observed replica is ready")
        (seen,) = await replicas(b, "outside")
        assert seen["node"] == "a"
        async with aiohttp.ClientSession() as session:
            assert (await chat(session, b, "outside"))[0] == 200  # served through b
        await engine.stop()

        async def down() -> bool:
            return [r["state"] for r in await replicas(a, "outside")] == ["failed"]

        await eventually(down, "the observed replica is failed once its engine stops")
        assert not any(r["deployment"] == "outside" for r in _launched(a.home))
    finally:
        await engine.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> None:
    async with session.post(url, json=body) as response:
        await response.read()


async def _requests(port: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    # the mock's own count of requests it took (vLLM's request_success counter name)
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"no request count in {text[:200]!r}")


def _engines_of(home: Path) -> set[int]:
    """Pids of every process that says it runs a replica of `home` (the engines' marks)."""
    mark = f"NVPAIR_REPLICA_HOME={home}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def _launched(home: Path) -> list[dict[str, Any]]:
    """What the supervisor launched under `home` (proc.json specs)."""
    out = []
    for record in home.glob("replicas/*/proc.json"):
        spec = json.loads(record.read_text())["spec"]
        out.append({"deployment": spec.get("served"), **spec})
    return out


async def test_a_stream_broken_after_its_first_bytes_ends_with_an_error_event(
    pair: list[Node],
) -> None:
    a, b = pair
    body = {"name": "slow-stream", "engine": "mock", "gpus": 0, "replicas": 1,
            "constraints": {"node": "b"}, "args": ["--tokens-per-s", "5"]}  # fmt: skip
    assert (await post(a, "/v1/deployments", body))[0] == 201
    await eventually(lambda: ready(a, "slow-stream", 1), "slow-stream ready", within_s=60)
    (rid,) = [r["id"] for r in await replicas(b, "slow-stream")]
    url = f"http://127.0.0.1:{a.ports['facade']}/v1/chat/completions"
    request = {"model": "slow-stream", "stream": True, "max_tokens": 100,
               "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with aiohttp.ClientSession() as session, session.post(url, json=request) as response:
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")  # the control: the stream had begun
        os.kill(engine_pids(b.home)[rid], signal.SIGKILL)
        rest = await response.content.read()  # ends cleanly: no reset raised here
    events = [e for e in rest.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error"
    assert error["message"] in {
        "engine closed the connection",
        "member unreachable",
        "engine unreachable",
    }

    async def job_failed() -> bool:
        jobs = [j for j in await a.jobs() if j["model"] == "slow-stream"]
        return [j["state"] for j in jobs] == ["failed"] and jobs[0]["error"] == error["message"]

    await eventually(job_failed, "the job is failed with the same normalised error")
