"""The engine supervisor (issue 13, item 3) with real processes: nvpair's mock engine and
`fake_engine.py` started through templates, real signals, real files under a real home."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agent.engines.proc_os import identify
from agent.engines.proc_state import TooManyReplicas, UnknownTemplate
from agent.engines.supervisor import ReplicaState
from agent.engines.templates import BUILTIN_TEMPLATES
from tests.agent.engine_harness import Harness, open_harness, serves, state_of
from tests.fixtures.waiting import eventually


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with open_harness(tmp_path) as opened:
        yield opened


async def test_a_mock_engine_starts_becomes_ready_and_answers(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("a", "mock")
    status = supervisor.launch(spec)
    assert status.state is ReplicaState.STARTING
    assert harness.port_range[0] <= status.port <= harness.port_range[1]
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "the mock engine is ready")
    assert await serves(current().url, "model-a")
    assert list(harness.pids()) == [current().pid]
    assert supervisor.launch(spec).pid == current().pid  # a second launch is a no-op
    assert list(harness.pids()) == [current().pid]
    assert harness.changes >= 2  # starting, ready
    assert supervisor.logs(spec.replica_id) == harness.home / "replicas" / spec.replica_id / (
        "engine.log"
    )


async def test_a_killed_engine_is_restarted_and_ready_again(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("k", "mock")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "ready")
    first = current().pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await eventually(
        lambda: current().restarts == 1 and current().state is ReplicaState.READY,
        "the engine is restarted and ready again",
    )
    assert current().pid not in (None, first)
    assert "SIGKILL" in (current().last_error or "")
    assert await serves(current().url, "model-k")
    assert list(harness.pids()) == [current().pid]


async def test_an_engine_never_ready_fails_with_its_last_log_lines(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("slow", "loader")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().pid is not None, "the engine runs")
    pid = current().pid
    await eventually(lambda: current().state is ReplicaState.FAILED, "it is reported failed")
    assert "not ready within" in (current().last_error or "")
    assert any("loading weights" in line for line in current().log_tail)
    assert current().pid is None
    await eventually(lambda: not harness.pids(), "the never-ready engine is stopped")
    assert pid not in harness.pids()


async def test_an_engine_that_exits_at_once_fails_without_restarts(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("bad", "crasher")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.FAILED, "it is reported failed")
    assert "exited with status 3 before it was ever ready" in (current().last_error or "")
    assert any("bad flag --tp" in line for line in current().log_tail)
    assert current().restarts == 0
    assert not (harness.home / "replicas" / spec.replica_id / "proc.json").exists()


async def test_a_crash_loop_ends_in_failed(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("loop", "flaky")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)

    async def poke() -> bool:  # the fake engine exits after answering its first request
        if current().state is ReplicaState.READY:
            try:
                async with aiohttp.ClientSession() as session:
                    await (await session.get(current().url + "/x")).read()
            except aiohttp.ClientError:
                pass
        return current().state is ReplicaState.FAILED

    await eventually(poke, "the crash loop is reported", within_s=60)
    assert "crash loop" in (current().last_error or "")
    assert current().restarts == 4  # five exits within a minute: the fifth is not restarted
    assert supervisor.launch(spec).state is ReplicaState.FAILED  # not restarted by a launch
    await supervisor.stop(spec.replica_id)
    assert supervisor.status(spec.replica_id) is None


async def test_a_program_that_does_not_exist_fails(harness: Harness) -> None:
    supervisor = harness.supervisor(templates={"vllm": BUILTIN_TEMPLATES["vllm"]})
    spec = harness.spec("nov", "vllm")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.FAILED, "it is reported failed")
    assert "could not start 'vllm'" in (current().last_error or "")


async def test_stop_sends_sigterm_to_the_group_and_the_engine_is_gone(harness: Harness) -> None:
    supervisor = harness.supervisor()
    spec = harness.spec("t", "fake")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "ready")
    pid = current().pid
    await supervisor.stop(spec.replica_id)
    assert (harness.home / "term-marker").read_text() == "SIGTERM"
    assert pid not in harness.pids()
    assert supervisor.replicas() == []
    assert not (harness.home / "replicas" / spec.replica_id / "proc.json").exists()
    assert supervisor.logs(spec.replica_id).exists()  # its log stays for `nvpair logs`


async def test_the_engines_workers_go_with_it_on_stop_and_on_a_crash(harness: Harness) -> None:
    supervisor = harness.supervisor(stop_grace_s=1.0)
    spec = harness.spec("w", "workers")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "ready")
    await eventually(lambda: len(harness.pids()) == 2, "the engine and its worker run")
    leader = current().pid
    assert leader is not None
    os.kill(leader, signal.SIGKILL)  # the worker is left behind: it must not hold the GPUs
    await eventually(lambda: current().restarts == 1 and current().state is ReplicaState.READY,
                     "restarted")  # fmt: skip
    await eventually(lambda: len(harness.pids()) == 2, "one engine and one worker, not two")
    assert current().pid in harness.pids()
    await supervisor.stop(spec.replica_id)
    assert harness.pids() == {}


async def test_503_while_loading_is_not_ready_yet(harness: Harness) -> None:
    probes_before_ready: list[int] = []

    def changed() -> None:  # at the moment it turns ready: how many 503s had it answered?
        status = supervisor.status(spec.replica_id)
        if status is not None and status.state is ReplicaState.READY:
            log = supervisor.logs(spec.replica_id).read_text()
            probes_before_ready.append(log.count("GET /health 503"))

    supervisor = harness.supervisor(on_change=changed)
    spec = harness.spec("l", "llama")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "ready after loading")
    assert probes_before_ready == [5]


async def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace(harness: Harness) -> None:
    supervisor = harness.supervisor(stop_grace_s=0.5)
    spec = harness.spec("s", "stubborn")
    supervisor.launch(spec)
    current = state_of(supervisor, spec)
    await eventually(lambda: current().state is ReplicaState.READY, "ready")
    pid = current().pid
    assert pid is not None
    await supervisor.stop(spec.replica_id)
    assert identify(pid) is None
    assert not harness.pids()


async def test_cuda_visible_devices_is_the_replicas_gpu_uuids(harness: Harness) -> None:
    supervisor = harness.supervisor()
    two = harness.spec("g2", "fake", gpu_uuids=("GPU-1a2b", "GPU-3c4d"))
    none = harness.spec("g0", "fake")
    supervisor.launch(two)
    supervisor.launch(none)
    for spec in (two, none):
        await eventually(lambda s=spec: state_of(supervisor, s)().state is ReplicaState.READY, "up")
    assert "CUDA_VISIBLE_DEVICES='GPU-1a2b,GPU-3c4d'" in supervisor.logs(two.replica_id).read_text()
    assert "CUDA_VISIBLE_DEVICES=''" in supervisor.logs(none.replica_id).read_text()
    assert state_of(supervisor, two)().port != state_of(supervisor, none)().port


async def test_bounds_and_unknown_templates_are_refused_before_anything_runs(
    harness: Harness,
) -> None:
    supervisor = harness.supervisor(max_replicas=1)
    with pytest.raises(UnknownTemplate, match="no template 'tgi'"):
        supervisor.launch(harness.spec("u", "tgi"))
    supervisor.launch(harness.spec("one", "fake"))
    with pytest.raises(TooManyReplicas):
        supervisor.launch(harness.spec("two", "fake"))
    assert [s.replica_id for s in supervisor.replicas()] == [harness.spec("one", "fake").replica_id]
