"""The facade in one process, through its ports: a real mock engine on 127.0.0.1, a real
scheduling view over a node record, and the lifecycle events it hands to `submit`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from agent.core.errors import MemberUnreachable
from agent.engines.gpus import simulate
from agent.engines.registry import Engines
from agent.mock.engine import MockEngine
from agent.serving.facade import Facade
from agent.serving.view import SchedulingView
from scheduler.replicas import ReplicaView
from tests.fixtures.records import node_record
from tests.fixtures.waiting import eventually
from workload_manager.workload import Workload

ME = "nod_01jzfacade0000000000000000"
MARKER = "PROMPT-MARKER-7f3a"


@dataclass
class Rig:
    facade: Facade
    engine: MockEngine
    engines: Engines
    events: list[tuple[str, Workload]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.facade.port}"

    def finished(self) -> list[Workload]:
        return [r for m, r in self.events if m in ("workload:completed", "workload:errored")]

    async def aclose(self) -> None:
        await self.facade.aclose()
        await self.engines.aclose()
        await self.engine.aclose()


async def rig(
    engine: MockEngine,
    queue_limit: int = 8,
    api_keys: dict[str, str] | None = None,
    wait: tuple[int, float] = (64, 30.0),
    replicas: list[ReplicaView] | None = None,
) -> Rig:
    await engine.start()
    engines = Engines([("vllm-0", "vllm", engine.url)])
    await engines.probe()
    gpus = simulate("l4:1", ME)
    record = node_record(
        ME,
        queueLimit=queue_limit,
        devices=gpus.devices,
        domains=gpus.domains,
        engines=engines.current,
    )
    view = SchedulingView(
        self_id=ME,
        records=lambda: [record],
        record_of=lambda node: record if node == ME else None,
        is_member=lambda node: True,
        reachable=lambda node, now: True,
        remote_load=dict,
    )

    def forward(node: str, path: str, body: bytes, replica: str, content_type: str) -> object:
        raise MemberUnreachable(node)  # one node: nothing is forwarded

    events: list[tuple[str, Workload]] = []
    facade = Facade(
        node_id=ME,
        view=view,
        engines=engines,
        forward=forward,
        submit=lambda method, record: events.append((method, record)),
        host="127.0.0.1",
        port=0,
        api_keys=api_keys or {},
        queue_limit=queue_limit,
        wait=wait,
        replicas=lambda: replicas or [],
        replica_url=lambda _replica: engine.url,  # the one here; another's is forwarded
    )
    await facade.start()
    return Rig(facade, engine, engines, events)


@pytest.fixture
async def solo() -> AsyncIterator[Rig]:
    r = await rig(MockEngine(model="m1"))
    yield r
    await r.aclose()


def chat(model: str = "m1", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": MARKER}], **extra}


async def test_a_request_is_a_job_queued_running_completed(solo: Rig) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(solo.url + "/v1/chat/completions", json=chat()) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["message"]["content"]
        async with session.post(
            solo.url + "/v1/chat/completions", json=chat(stream=True)
        ) as response:
            assert response.status == 200
            assert b"data: [DONE]" in await response.read()
    methods = [m for m, _ in solo.events]
    assert methods == ["workload:submitted", "workload:started", "workload:completed"] * 2
    first = [r for _, r in solo.events[:3]]
    assert [r.state.value for r in first] == ["queued", "running", "completed"]
    assert [r.seq for r in first] == sorted(r.seq for r in first)
    assert {r.id for r in first} == {"1"}
    assert first[1].scheduledOn == ME
    assert first[2].engine == "vllm"
    assert all(MARKER not in repr(r) for _, r in solo.events)


async def test_unknown_model_is_404_and_no_job(solo: Rig) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(solo.url + "/v1/chat/completions", json=chat("nope")) as r404:
            assert r404.status == 404
            assert (await r404.json())["error"]["code"] == "model_not_found"
        async with session.post(solo.url + "/v1/chat/completions", data=b"{not json") as r400:
            assert r400.status == 400
        # The control: a good request after the refused ones is one job.
        async with session.post(solo.url + "/v1/chat/completions", json=chat()) as ok:
            assert ok.status == 200
    assert solo.events[0][0] == "workload:submitted"
    assert len(solo.finished()) == 1


async def test_an_engine_error_fails_the_job_without_its_words() -> None:
    r = await rig(MockEngine(model="m1", fail_rate=1.0))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(r.url + "/v1/chat/completions", json=chat()) as response,
        ):
            assert response.status == 500
        (done,) = r.finished()
        assert done.state.value == "failed"
        assert done.error == "engine returned HTTP 5xx"  # the vocabulary, no engine words
    finally:
        await r.aclose()


async def test_a_target_that_fails_before_any_byte_fails_over_and_the_job_says_so() -> None:
    # Two replicas of m1, tied on load: "r1" (first by id) on a member that cannot be
    # reached, "r2" here. The job starts on the first, fails over to the second, completes.
    there = ReplicaView("r1", "nod_b", "m1", kind="vllm")
    here = ReplicaView("r2", ME, "m1", kind="vllm")
    r = await rig(MockEngine(model="m1"), replicas=[there, here])
    r.facade.policy = "load"  # on load, "r1" first (prefix routing: wherever the prompt says)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(r.url + "/v1/chat/completions", json=chat()) as response,
        ):
            assert response.status == 200
        assert [m for m, _ in r.events] == [
            "workload:submitted",
            "workload:started",
            "workload:started",  # the second target: a second start, a new seq
            "workload:completed",
        ]
        queued, first, second, done = (record for _, record in r.events)
        assert [x.seq for x in (queued, first, second, done)] == [1, 2, 3, 4]
        assert (first.scheduledOn, second.scheduledOn, done.scheduledOn) == ("nod_b", ME, ME)
        assert first.startedAt == second.startedAt == done.startedAt  # the first start's
        assert {first.engine, second.engine, done.engine} == {"vllm"}
        assert (done.state.value, done.error) == ("completed", None)
        assert r.facade.failovers == 1
    finally:
        await r.aclose()


async def test_full_queue_is_429_and_a_client_that_leaves_is_cancelled() -> None:
    r = await rig(MockEngine(model="m1", tokens_per_s=20), queue_limit=1, wait=(0, 1.0))
    try:
        leaving = aiohttp.ClientSession()
        slow = asyncio.create_task(
            leaving.post(r.url + "/v1/chat/completions", json=chat(max_tokens=400))
        )
        await eventually(lambda: r.engine.in_flight == 1, "the first request at the engine")
        async with (
            aiohttp.ClientSession() as session,
            session.post(r.url + "/v1/chat/completions", json=chat()) as busy,
        ):
            assert busy.status == 429
            assert busy.headers["Retry-After"] == "1"
        slow.cancel()
        await leaving.close()  # the client hangs up mid-answer: its connection closes
        await eventually(lambda: bool(r.finished()), "the first job ended", within_s=5)
        (done,) = r.finished()
        assert done.state.value == "cancelled"
    finally:
        await r.aclose()


async def test_unknown_routes_and_methods_get_openai_shaped_errors(solo: Rig) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(solo.url + "/v1/no-such-route") as response:
            assert response.status == 404
            error = (await response.json())["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
        async with session.get(solo.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert "POST" in response.headers["Allow"]
            assert (await response.json())["error"]["code"] == "method_not_allowed"
        # The control: the routes that exist still answer.
        async with session.get(solo.url + "/v1/models") as response:
            assert response.status == 200


async def test_models_obey_the_api_keys() -> None:
    keyed = await rig(MockEngine(model="m1"), api_keys={"team-a": "sk-test-1"})
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(keyed.url + "/v1/models") as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "invalid_api_key"
            headers = {"Authorization": "Bearer sk-test-1"}
            async with session.get(keyed.url + "/v1/models", headers=headers) as response:
                assert response.status == 200
                assert [m["id"] for m in (await response.json())["data"]] == ["m1"]
    finally:
        await keyed.aclose()
