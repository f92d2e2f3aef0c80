"""Token usage reaches the plane with each finished job (a real Jobs store and usage store,
the agent's real sync, a real plane on PostgreSQL): the fleet summary sums tokens per model
and per key as the node recorded them; a replayed batch, a rebuild of the rollups and a row
for a job the plane does not hold change nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agent.config import PlaneSettings
from agent.engines.gpus import simulate
from agent.plane_link.sync import PlaneSync
from agent.serving.usage_store import UsageRow, UsageStore
from broker.jobs import JobsStore, JobsWriter
from certs import new_node_id
from plane.core.wire import JobUsage, SyncBatch
from plane.db.connection import connection
from plane.db.rollups import rebuild_rollups
from tests.fixtures.records import node_record, workload

from ..plane_client import Plane, enrol

# (id, model, requester, prompt, completion)
JOBS = [("1", "llama", "team-a", 10, 20), ("2", "llama", None, 3, 4), ("3", "qwen", "team-a", 5, 6)]


async def usage_of(plane: Plane, token: str) -> dict[str, Any]:
    status, body = await plane.call("GET", "/v1/fleet/summary", token)
    assert status == 200, body
    usage: dict[str, Any] = body["jobs"]["usage"]
    return usage


async def test_usage_sums_per_model_and_key(plane: Plane, tmp_path: Path) -> None:
    cluster, token = await enrol(plane, "lab")
    node = new_node_id()
    gpus = simulate("l4:1", node)
    record = node_record(node, devices=gpus.devices, domains=gpus.domains)
    store = await JobsStore.open(tmp_path / "jobs.db")
    usage = await UsageStore.open(tmp_path / "usage.db")
    synced = asyncio.Event()

    async def sleep(_: float) -> None:
        synced.set()
        await asyncio.Event().wait()  # one round is enough here

    async with JobsWriter(store) as writer:
        for wid, model, requester, prompt, completion in JOBS:
            writer.upsert(workload(wid, 3, origin=node, model=model, requesterId=requester))
            usage.add(UsageRow("r", wid, model, requester, prompt, completion, None, 9, 1))
        writer.upsert(workload("4", 1, origin=node))  # still queued: no usage yet
        sync = PlaneSync(
            PlaneSettings(url=plane.url, token=token),
            identity=plane.ca(token).node(node),
            store=store,
            writer=writer,
            record=lambda: record,
            sleep=sleep,
            usage=usage,
        )
        running = asyncio.create_task(sync.run())
        try:
            await asyncio.wait_for(synced.wait(), 20)
        finally:
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
        assert sync.failures == 0, sync.last_error
    expected = {
        "byModel": {
            "llama": {"promptTokens": 13, "completionTokens": 24, "jobs": 2},
            "qwen": {"promptTokens": 5, "completionTokens": 6, "jobs": 1},
        },
        "byKey": {
            "team-a": {"promptTokens": 15, "completionTokens": 26, "jobs": 2},
            "none": {"promptTokens": 3, "completionTokens": 4, "jobs": 1},
        },
    }
    assert await usage_of(plane, token) == expected

    # The same usage again, and a row for a job the plane never got: nothing changes.
    again = SyncBatch(
        nodeId=node,
        generation=record.generation,
        jobs=[workload(w, 3, origin=node, model=m, requesterId=r) for w, m, r, _, _ in JOBS],
        usage=[
            *(
                JobUsage(runId="r", id=w, promptTokens=p, completionTokens=c)
                for w, *_, p, c in JOBS
            ),
            JobUsage(runId="r", id="99", promptTokens=1000, completionTokens=1000),
        ],
    )
    await plane.store.sync(cluster, again)
    assert await usage_of(plane, token) == expected
    async with connection(plane.store.pool) as conn:
        await rebuild_rollups(conn)
        rows = await (await conn.execute("SELECT count(*) FROM job_usage")).fetchone()
    assert rows == (3,)
    assert await usage_of(plane, token) == expected
    await usage.close()
    await store.close()
