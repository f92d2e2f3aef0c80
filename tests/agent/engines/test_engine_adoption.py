"""Engines outlive the agent (issue 13, item 3): a new supervisor on the same home adopts
the engines still running (pid + start time), never starts a second one, cleans up stale
records without signalling a reused pid; and every file it writes is private."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.engines.ports import PortPool
from agent.engines.proc_files import ProcRecord, ReplicaFiles, prune_stopped
from agent.engines.proc_os import boot_id, identify
from agent.engines.proc_state import NoFreePort
from agent.engines.supervisor import ReplicaState
from tests.agent.engine_harness import Harness, open_harness, serves, state_of
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import engine_ports


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with open_harness(tmp_path) as opened:
        yield opened


async def test_a_new_supervisor_adopts_the_running_engine_without_a_second_one(
    harness: Harness,
) -> None:
    first = harness.supervisor()
    spec = harness.spec("ad", "mock")
    first.launch(spec)
    await eventually(
        lambda: state_of(first, spec)().state is ReplicaState.READY, "ready under the first"
    )
    pid = state_of(first, spec)().pid
    await first.aclose()  # the agent goes away without stopping its engines
    assert list(harness.pids()) == [pid]

    second = harness.supervisor()
    assert second.adopt() == [spec.replica_id]
    current = state_of(second, spec)
    assert (current().pid, current().adopted) == (pid, True)
    await eventually(lambda: current().state is ReplicaState.READY, "ready again, adopted")
    assert second.launch(spec).pid == pid  # the caller's launch is a no-op
    assert list(harness.pids()) == [pid]
    assert await serves(current().url, "model-ad")
    assert await second.retain([]) == [spec.replica_id]  # it should not exist: stopped
    assert not harness.pids()


async def test_an_adopted_engine_that_dies_is_restarted(harness: Harness) -> None:
    first = harness.supervisor()
    spec = harness.spec("ar", "mock")
    first.launch(spec)
    await eventually(lambda: state_of(first, spec)().state is ReplicaState.READY, "ready")
    pid = state_of(first, spec)().pid
    assert pid is not None
    await first.aclose()
    second = harness.supervisor()
    second.adopt()
    current = state_of(second, spec)
    os.kill(pid, signal.SIGKILL)
    await eventually(
        lambda: current().restarts == 1 and current().state is ReplicaState.READY,
        "restarted by the adopting supervisor",
    )
    assert list(harness.pids()) == [current().pid]


def test_stale_records_are_cleaned_up_and_their_pid_left_alone(harness: Harness) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    me = identify(os.getpid())
    assert me is not None
    records = {
        "dead": (int(dead.stdout), 12345),
        "reused": (os.getpid(), me.start_ticks + 1),  # a live pid, but another process now
    }
    for name, (pid, ticks) in records.items():
        spec = harness.spec(name, "mock", port=harness.port_range[0])
        ReplicaFiles(harness.home / "replicas" / spec.replica_id).write_record(
            ProcRecord(
                pid=pid,
                start_ticks=ticks,
                boot_id=boot_id(),
                port=spec.port,
                ready_path="/v1/models",
                spec=spec,
            )
        )
    garbage = harness.home / "replicas" / "rep_garbage"
    garbage.mkdir()
    (garbage / "proc.json").write_text("{not json")
    supervisor = harness.supervisor()
    assert supervisor.adopt() == []
    assert supervisor.replicas() == []
    assert list((harness.home / "replicas").glob("*/proc.json")) == []
    assert identify(os.getpid()) == me  # we were not signalled


async def test_files_are_private_under_umask_000(harness: Harness) -> None:
    old = os.umask(0)
    try:
        supervisor = harness.supervisor()
        spec = harness.spec("m", "fake")
        supervisor.launch(spec)
        await eventually(lambda: state_of(supervisor, spec)().pid is not None, "spawned")
        files = ReplicaFiles(harness.home / "replicas" / spec.replica_id)
        # Once it has said it serves, the engine writes nothing more to its log.
        await eventually(lambda: b"serving" in files.log.read_bytes(), "the engine serves")
        files.log.write_bytes(b"x" * 200)  # the engine appends; make it big enough to rotate
        assert files.rotate_if_large(limit=100)
        assert files.log.stat().st_size == 0
        assert files.log.with_name("engine.log.1").read_bytes() == b"x" * 100
    finally:
        os.umask(old)
    modes = {
        p.relative_to(harness.home).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in (harness.home / "replicas").rglob("*")
    }
    modes["replicas"] = stat.S_IMODE((harness.home / "replicas").stat().st_mode)
    rid = spec.replica_id
    assert {f"replicas/{rid}/{n}" for n in ("engine.log", "engine.log.1", "proc.json")} <= set(
        modes
    )
    wrong = {path: f"{mode:04o}" for path, mode in modes.items()
             if mode != (0o700 if (harness.home / path).is_dir() else 0o600)}  # fmt: skip
    assert wrong == {}


def test_the_port_pool_skips_ports_in_use_and_held() -> None:
    # Three ports of this worker's own band: `free_port`'s neighbours are other workers'
    # ports, one of which another worker's agent may hold (seen at -n 4).
    low, _ = engine_ports(3)
    with socket.socket() as listener:
        # As every server binds (asyncio's set it): a connection an earlier engine on this
        # port closed first lingers in TIME_WAIT for a minute, and once this worker's band
        # wraps -- sooner the faster the suite -- a bare bind() found the port "in use".
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", low))
        listener.listen()
        pool = PortPool(low, low + 2)
        assert pool.take("a") == low + 1
        assert pool.take("a") == low + 1
        assert pool.take("b") == low + 2
        with pytest.raises(NoFreePort, match="taken"):
            pool.take("c")
        pool.release("a")
        assert pool.take("c") == low + 1


async def test_only_the_newest_stopped_replicas_keep_their_logs(harness: Harness) -> None:
    root = harness.home / "replicas"
    for n in range(5):
        files = ReplicaFiles(root / f"rep_old{n}")
        os.close(files.open_log())  # stopped: its log is left, no proc.json
        os.utime(files.directory, ns=(n * 10**9, n * 10**9))
    supervisor = harness.supervisor(keep_stopped=2)
    spec = harness.spec("new", "fake")
    supervisor.launch(spec)
    await eventually(lambda: state_of(supervisor, spec)().pid is not None, "spawned")
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(["rep_old3", "rep_old4", spec.replica_id])
    removed = prune_stopped(harness.home, keep=0, running={spec.replica_id})
    assert removed == ["rep_old4", "rep_old3"]
    with pytest.raises(ValueError, match="replica id"):
        supervisor.logs("../../etc")


async def test_an_engine_without_a_record_is_stopped_not_duplicated(harness: Harness) -> None:
    # The agent died between spawning the engine and writing its proc.json.
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    marks = {"NVPAIR_REPLICA": harness.spec("orphan", "mock").replica_id}
    ours = {**os.environ, **marks, "NVPAIR_REPLICA_HOME": str(harness.home)}
    theirs = {**os.environ, **marks, "NVPAIR_REPLICA_HOME": f"{harness.home}-other"}
    orphan = await asyncio.create_subprocess_exec(*sleep, env=ours)
    elsewhere = await asyncio.create_subprocess_exec(*sleep, env=theirs)
    try:
        await eventually(lambda: len(harness.pids()) == 2, "both marked processes run")
        assert harness.supervisor().adopt() == []
        async with asyncio.timeout(20):
            assert await orphan.wait() == -signal.SIGKILL  # the unrecorded engine is killed
        assert elsewhere.returncode is None  # another home's engine is not ours
        assert elsewhere.pid in harness.pids()
    finally:
        for process in (orphan, elsewhere):
            if process.returncode is None:
                process.kill()
            await process.wait()
