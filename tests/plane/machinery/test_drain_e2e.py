"""A drain started in the plane completes in the cluster, and its phase is visible in both
(issue 16, done-when): `nvpair plane serve` on a real PostgreSQL, two real agents enrolled
in it, the drain POSTed as the admin, then the plane's `GET /v1/operations/{id}` and the
target's `nvpair ops` both saying succeeded. The same agents' components and node-joined
events are in the plane's views.

The operation travels down the desired-state channel (`GET /v1/desired`, fetched by
agent/plane_link/down.py) and its phases come back up in the target's sync batches.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.agent.harness import eventually, make_node, start_cluster

from ..plane_process import ADMIN, PlaneProcess, point_at_plane


@pytest.fixture
async def plane_process(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    process = PlaneProcess(pg_dsn)
    await process.start()
    yield process
    await process.stop()


async def test_a_drain_started_in_the_plane_completes_in_the_cluster(
    tmp_path: Path, plane_process: PlaneProcess
) -> None:
    token = (await plane_process.cli("enrol-cluster", "lab")).strip()
    nodes = [make_node(tmp_path, name, "l4:1") for name in ("a", "b")]
    for node in nodes:
        point_at_plane(node.home, plane_process, token)
    cluster = start_cluster(nodes)
    a, b = await cluster.__anext__()
    try:
        target = await b.node_id()

        async def in_plane() -> bool:
            rows = (await plane_process.get("/v1/events?kind=node-joined"))["items"]
            return {e["about"] for e in rows} == {await a.node_id(), target}

        await eventually(in_plane, "both nodes' node-joined events in the plane")
        components = (await plane_process.get(f"/v1/components?node={target}"))["items"]
        assert "agent" in [c["name"] for c in components]

        async with (
            aiohttp.ClientSession() as session,
            session.post(
                plane_process.url + "/v1/operations",
                json={"kind": "drain", "target": target, "reason": "kernel update"},
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as response,
        ):
            assert response.status == 201, await response.text()
            op = await response.json()

        async def done_in_plane() -> bool:
            seen = await plane_process.get(f"/v1/operations/{op['id']}")
            return bool(seen["phase"] == "succeeded")

        await eventually(done_in_plane, "the plane seeing the drain succeed")
        code, out, err = await b.cli("ops", "--json")
        assert code == 0, err
        [here] = [o for o in json.loads(out) if o["id"] == op["id"]]
        assert (here["kind"], here["phase"], here["requester"]) == (
            "drain",
            "succeeded",
            "plane:admin",
        )
        members = {n["nodeId"]: n for n in await a.get("/v1/nodes")}
        assert members[target]["cordoned"] is True  # the cluster sees the drained node
        code, out, err = await a.cli("ops", "--json")
        assert code == 0, err
        assert op["id"] not in out  # only its target carries it out
    finally:
        with pytest.raises(StopAsyncIteration):
            await cluster.__anext__()
