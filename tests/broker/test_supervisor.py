"""The broker supervising a real workload manager child over stdio."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.jobs import JobsStore, JobsWriter
from broker.supervisor import ManagerSupervisor
from certs import ClusterDir
from tests.workload_manager.cluster_harness import eventually, eventually_async, free_port
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
