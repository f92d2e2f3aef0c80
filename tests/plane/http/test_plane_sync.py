"""The agent's plane sync in one process, through its ports: a real Jobs store (SQLite), a
real plane HTTP server on a real PostgreSQL, and the retries driven step by step instead of
waited for. The plane goes away and comes back; nothing is lost or counted twice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.config import PlaneSettings
from agent.engines.gpus import simulate
from agent.plane_link.sync import PlaneSync
from broker.jobs import JobsStore, JobsWriter
from certs import new_node_id
from plane.http.server import PlaneServer
from tests.fixtures.records import node_record, workload
from tests.workload_manager.cluster_harness import free_port

from ..plane_client import Plane, enrol


class Steps:
    """A sleep the test drives: each `step()` lets the sync make one more attempt."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._go = asyncio.Event()
        self._asleep = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        self._asleep.set()
        await self._go.wait()
        self._go.clear()

    async def asleep(self) -> None:
        await asyncio.wait_for(self._asleep.wait(), 20)

    async def step(self) -> None:
        self._asleep.clear()
        self._go.set()
        await self.asleep()


async def plane_jobs(plane: Plane, cluster: str, token: str) -> dict[str, tuple[str, int]]:
    status, body = await plane.call("GET", f"/v1/jobs?cluster={cluster}&limit=1000", token)
    assert status == 200, body
    return {j["id"]: (j["state"], j["seq"]) for j in body["jobs"]}


async def test_an_outage_loses_nothing_and_duplicates_nothing(plane: Plane, tmp_path: Path) -> None:
    cluster, token = await enrol(plane, "lab")
    node = new_node_id()
    gpus = simulate("l4:1", node)
    record = node_record(node, devices=gpus.devices, domains=gpus.domains)
    port = free_port()
    server = PlaneServer(plane.store, host="127.0.0.1", port=port)
    await server.start()
    store = await JobsStore.open(tmp_path / "jobs.db")
    steps = Steps()
    async with JobsWriter(store) as writer:
        for wid, seq in (("1", 1), ("2", 3)):
            writer.upsert(workload(wid, seq, origin=node))
        sync = PlaneSync(
            PlaneSettings(url=f"http://127.0.0.1:{port}", token=token),
            identity=plane.ca(token).node(node),  # it signs every batch as this node
            store=store,
            writer=writer,
            record=lambda: record,
            sleep=steps.sleep,
        )
        running = asyncio.create_task(sync.run())
        try:
            await steps.asleep()  # the first attempt is done
            assert await plane_jobs(plane, cluster, token) == {
                "1": ("queued", 1),
                "2": ("completed", 3),
            }
            assert await store.unsynced(node, 100) == []

            await server.aclose()  # the plane goes away while jobs move on
            writer.upsert(workload("1", 3, origin=node))
            writer.upsert(workload("3", 1, origin=node))
            await steps.step()
            await steps.step()
            assert sync.failures == 2
            assert sync.last_error is not None
            assert all(0.2 <= delay <= 5.0 for delay in steps.delays[1:])
            assert sorted(r.id for r in await store.unsynced(node, 100)) == ["1", "3"]

            server = PlaneServer(plane.store, host="127.0.0.1", port=port)
            await server.start()  # it comes back
            await steps.step()
            assert sync.failures == 0
            assert await plane_jobs(plane, cluster, token) == {
                "1": ("completed", 3),
                "2": ("completed", 3),
                "3": ("queued", 1),
            }
            assert await store.unsynced(node, 100) == []
            assert sync.synced == 4  # two, then the two that changed: none sent twice
        finally:
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            await server.aclose()
    await store.close()
