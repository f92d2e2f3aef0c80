"""The broker supervising a real workload manager child over stdio."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.errors import ManagerPortInUse, ManagerRefused, ManagerStartFailed, ManagerUnavailable
from broker.jobs import JobsStore, JobsWriter
from broker.liveness import Liveness
from broker.supervisor import ManagerSupervisor
from certs import ClusterDir
from tests.fixtures.records import workload
from tests.workload_manager.cluster_harness import eventually, eventually_async, free_port
from workload_manager.jsonrpc import METHOD_NOT_FOUND
from workload_manager.manager import Peer
from workload_manager.workload import WorkloadRemoval, decode_workload


def record(wid: str, seq: int = 1) -> str:
    return json.dumps(
        {
            "id": wid,
            "model": "m",
            "engine": "vllm",
            "runId": "r",
            "state": {1: "queued", 2: "running"}[seq],
            "originatedFrom": "nod_x",
            "createdAt": 1,
            "seq": seq,
        }
    )


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[JobsStore, JobsWriter, ClusterDir]]:
    cluster = ClusterDir(tmp_path / "cluster")
    cluster.init("t", "a", ["127.0.0.1"])
    store = await JobsStore.open(tmp_path / "jobs.db")
    async with JobsWriter(store) as writer:
        yield store, writer, cluster
    await store.close()


def supervisor(store: JobsStore, writer: JobsWriter, cluster: ClusterDir) -> ManagerSupervisor:
    return ManagerSupervisor(
        store=store,
        writer=writer,
        port=free_port(),
        cluster_dir=cluster.path,
        extra_env={"NVPAIR_WM_BIND": "127.0.0.1"},
    )


async def until_view_loaded(sup: ManagerSupervisor) -> None:
    # The manager asks for the view right after `ready`; the answer lands a moment later.
    async def loaded() -> bool:
        status = await sup.request("manager:status")
        return bool(status["workloads"] == {"held": 1, "tombstones": 1})

    await eventually_async(loaded, "the manager loaded the store's view")


async def test_ready_peers_and_status(parts: tuple[JobsStore, JobsWriter, ClusterDir]) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    sup.set_peers([Peer(nodeId="nod_b", host="127.0.0.1", port=1)])
    await sup.start()
    try:
        assert sup.state == "running"
        status = await sup.request("manager:status")
        assert status["peers"] == [{"nodeId": "nod_b", "host": "127.0.0.1", "port": 1}]
        assert status["nodeId"] == cluster.node_id()
        assert sup.version == status["version"]
    finally:
        await sup.aclose()
    assert sup.pid is None


async def test_killed_manager_is_restarted_and_gets_the_store_view(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    store, writer, cluster = parts
    # what the store holds before the manager starts: the manager must learn it
    await store.write(
        [decode_workload(record("1", 2))],
        [WorkloadRemoval(workloadId="9", originatedFrom="nod_x")],
        now=0,
    )
    sup = supervisor(store, writer, cluster)
    await sup.start()
    try:
        await until_view_loaded(sup)
        pid = sup.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: sup.restarts == 1 and sup.state == "running", "restart")
        assert sup.pid != pid
        await until_view_loaded(sup)
        assert sup.last_exit == -signal.SIGKILL
    finally:
        await sup.aclose()


async def test_crash_loop_is_reported(parts: tuple[JobsStore, JobsWriter, ClusterDir]) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    sup.argv = ["/bin/sh", "-c", "exit 3", "sh"]  # a manager that dies at once
    sup.backoff_base_s = sup.backoff_cap_s = 0.01
    task = asyncio.create_task(sup.start())
    try:
        await eventually(lambda: sup.state == "crash-loop", "crash loop")
        assert sup.last_exit == 3
        assert sup.restarts >= 5
    finally:
        task.cancel()
        await sup.aclose()


async def test_stop_escalates_to_sigkill(parts: tuple[JobsStore, JobsWriter, ClusterDir]) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    # A child that ignores SIGTERM and says ready.
    script = (
        "trap '' TERM; "
        'echo \'{"jsonrpc":"2.0","method":"ready","params":{"version":"x"}}\'; '
        "while true; do sleep 0.1; done"
    )
    sup.argv = ["/bin/sh", "-c", script, "sh"]
    sup.grace_s = 0.5
    await sup.start()
    pid = sup.pid
    await sup.aclose()
    assert sup.pid is None
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_manager_port_in_use_is_said_at_start_not_crash_looped(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    store, writer, cluster = parts
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        sup = supervisor(store, writer, cluster)
        sup.port = port
        started = time.monotonic()
        with pytest.raises(ManagerPortInUse) as refused:
            await sup.start()
        assert time.monotonic() - started < 10  # one child's start-up, not a backoff
    assert refused.value.port == port
    assert f"port {port}" in str(refused.value)
    assert "another agent may be running" in str(refused.value)
    assert sup.restarts == 0
    assert sup.last_exit == 2
    assert sup.pid is None  # no child left
    assert sup.state == "stopped"


async def test_another_exit_2_at_start_says_what_the_child_said(
    parts: tuple[JobsStore, JobsWriter, ClusterDir], capsys: pytest.CaptureFixture[str]
) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    sup.argv = ["/bin/sh", "-c", "echo 'some log line' >&2; echo 'sh: bad flag' >&2; exit 2", "sh"]
    with pytest.raises(ManagerStartFailed, match="status 2: sh: bad flag") as failed:
        await sup.start()
    assert failed.value.line == "sh: bad flag"
    assert sup.restarts == 0
    # The child's stderr went through to ours, as it came.
    assert "some log line\nsh: bad flag\n" in capsys.readouterr().err


async def test_requests_refused_or_unanswerable_are_typed(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    with pytest.raises(ManagerUnavailable, match="starting"):
        await sup.request("manager:status")  # not started yet
    await sup.start()
    try:
        with pytest.raises(ManagerRefused) as refused:
            await sup.request("no:such")
        assert refused.value.code == METHOD_NOT_FOUND
        assert refused.value.method == "no:such"
        assert "held" in (await sup.request("manager:status"))["workloads"]  # the control
    finally:
        await sup.aclose()
    with pytest.raises(ManagerUnavailable):
        await sup.request("manager:status")


async def test_a_supervisor_that_cannot_start_a_child_reports_it(
    parts: tuple[JobsStore, JobsWriter, ClusterDir], caplog: pytest.LogCaptureFixture
) -> None:
    store, writer, cluster = parts
    failed: list[str] = []
    sup = ManagerSupervisor(
        store=store,
        writer=writer,
        port=free_port(),
        cluster_dir=cluster.path,
        argv=[str(cluster.path / "no-such-program")],
        on_failure=lambda part, exc: failed.append(part),
    )
    with pytest.raises(ManagerUnavailable, match="FileNotFoundError"):
        await sup.start()
    assert failed == ["workload-manager"]
    assert sup.failure is not None
    assert "FileNotFoundError" in sup.failure
    assert sup.problem() == sup.failure
    assert "Traceback" in caplog.text


async def test_start_cancelled_or_stopped_leaves_no_child(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    store, writer, cluster = parts
    # A child that never says ready: start() waits until it is cancelled (a signal during
    # the agent's start-up) or the supervisor is stopped from elsewhere.
    never_ready = ["/bin/sh", "-c", "exec sleep 60", "sh"]
    sup = supervisor(store, writer, cluster)
    sup.argv = never_ready
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: sup.pid is not None, "the child runs")
    pid = sup.pid
    assert pid is not None
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert sup.pid is None
    assert sup.state == "stopped"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    other = supervisor(store, writer, cluster)
    other.argv = never_ready
    starting = asyncio.create_task(other.start())
    await eventually(lambda: other.pid is not None, "the child runs")
    await other.aclose()
    with pytest.raises(ManagerUnavailable, match="stopped before it was ready"):
        await starting
    assert other.pid is None


async def test_a_store_of_large_records_reaches_a_restarted_manager_whole(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    # 3,000 records with 4 KiB error texts: 2,000 of them in one page would be ~9 MiB, far
    # past the manager's 1 MiB frame limit, and the manager would start with no view.
    store, writer, cluster = parts
    error = "e" * 4096
    records = [
        workload(f"{i:05}", 3, state="failed", error=error, completedAt=2) for i in range(3000)
    ]
    removals = [WorkloadRemoval(workloadId=f"gone{i}", originatedFrom="nod_x") for i in range(50)]
    await store.write(records, removals, now=0)
    sup = supervisor(store, writer, cluster)
    await sup.start()
    try:

        async def loaded() -> bool:
            status = await sup.request("manager:status")
            return bool(status["workloads"] == {"held": 3000, "tombstones": 50})

        await eventually_async(loaded, "the manager loaded all 3,000 records and 50 removals")
    finally:
        await sup.aclose()


async def test_a_stalled_manager_is_killed_and_restarted(
    parts: tuple[JobsStore, JobsWriter, ClusterDir], caplog: pytest.LogCaptureFixture
) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    sup.liveness = Liveness(interval_s=0.2, deadline_s=0.5)
    await sup.start()
    pid = sup.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # alive, holding its pipes, answering nothing
    try:
        hung: list[str] = []

        def replaced() -> bool:
            problem = sup.problem()
            if problem is not None and "hung" in problem:
                hung.append(problem)
            return sup.state == "running" and sup.pid not in (None, pid)

        await eventually(replaced, "the stalled manager is replaced by a new one", within_s=5)
        assert hung, "problem() never said the manager hung"
        assert "did not answer manager:status within 0.5s" in hung[0]
        assert sup.problem() is None  # the new one runs
        assert sup.status()["hung"] is None
        assert sup.restarts == 1
        assert sup.last_exit == -signal.SIGKILL
        assert f"the workload manager (pid {pid}) is hung" in caplog.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await sup.aclose()


async def test_frames_a_stalled_manager_could_not_take_reach_its_successor(
    parts: tuple[JobsStore, JobsWriter, ClusterDir], caplog: pytest.LogCaptureFixture
) -> None:
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    sup.liveness = Liveness(interval_s=0.2, deadline_s=0.5)
    await sup.start()
    pid = sup.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        # What the agent stores and hands on while the manager is stalled: ~20 MiB, more
        # than the supervisor holds for a child that does not read.
        records = [workload(f"{i:05}", 1, error="e" * 4096) for i in range(5000)]
        await store.write(records, [], now=0)
        for rec in records:
            sup.send_event("workload:submitted", rec)
        assert sup.dropped > 0
        assert sup.status()["dropped"] == sup.dropped
        assert caplog.text.count("dropping frames for the workload manager") == 1  # per burst
        await eventually(
            lambda: sup.state == "running" and sup.pid not in (None, pid), "a new manager"
        )
        assert sup.restarts == 1

        async def caught_up() -> bool:
            status = await sup.request("manager:status")
            return bool(status["workloads"]["held"] == 5000)

        await eventually(caught_up, "the new manager holds what the stalled one missed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await sup.aclose()


async def test_a_removal_never_overtakes_the_held_events_of_its_job(
    parts: tuple[JobsStore, JobsWriter, ClusterDir],
) -> None:
    # A job's events are held a moment (broker.event_hold); a removal sent meanwhile must
    # reach the manager after them, or the job would arrive after its own tombstone.
    store, writer, cluster = parts
    sup = supervisor(store, writer, cluster)
    await sup.start()
    try:
        origin = cluster.node_id()
        assert origin is not None
        job = decode_workload(record("held").replace('"nod_x"', f'"{origin}"'))
        sup.send_event("workload:submitted", job)
        assert len(sup.held) == 1  # held, not sent
        sup.send_removal(WorkloadRemoval(workloadId="held", originatedFrom=origin))
        assert len(sup.held) == 0  # sent first, before the removal

        async def both_taken() -> bool:
            counters = (await sup.request("manager:status"))["counters"]
            return bool(counters["received_local"] == 2)

        await eventually_async(both_taken, "the event and the removal reach the manager")
        counters = (await sup.request("manager:status"))["counters"]
        assert counters["accepted"] == 1  # the event first: accepted ...
        assert counters["removals"] == 1  # ... then removed
        assert counters["blocked_by_tombstone"] == 0  # never after its tombstone
    finally:
        await sup.aclose()
