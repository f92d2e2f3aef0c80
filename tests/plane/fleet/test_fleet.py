"""Two clusters of real agents syncing into one real plane (`nvpair plane serve` on a real
PostgreSQL): the fleet view equals what the members say (a plane outage that loses nothing is
the fault tier's: tests/reliability/test_plane_outage.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.agent.harness import Node, eventually, make_node, start_cluster

from ..plane_process import PlaneProcess, point_at_plane


@pytest.fixture
async def plane(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    process = PlaneProcess(pg_dsn)
    await process.start()
    yield process
    await process.stop()


async def two_clusters(
    tmp_path: Path, plane: PlaneProcess, stack: AsyncExitStack
) -> list[list[Node]]:
    clusters = []
    for cname, names in (("east", ["e1", "e2"]), ("west", ["w1"])):
        token = (await plane.cli("enrol-cluster", cname)).strip()
        nodes = [
            make_node(tmp_path / cname, name, "h100-80gb-sxm:8" if name != "e2" else "l4:2")
            for name in names
        ]
        for node in nodes:
            point_at_plane(node.home, plane, token)
        generator = start_cluster(nodes)
        clusters.append(await generator.__anext__())
        stack.push_async_callback(_finish, generator)
    return clusters


async def _finish(generator: AsyncIterator[list[Node]]) -> None:
    with contextlib.suppress(StopAsyncIteration):
        await generator.__anext__()


async def plane_jobs(plane: PlaneProcess) -> dict[tuple[str, str, str], dict[str, Any]]:
    jobs: dict[tuple[str, str, str], dict[str, Any]] = {}
    after = None
    while True:
        page = await plane.get("/v1/jobs?limit=1000" + (f"&after={after}" if after else ""))
        for j in page["jobs"]:
            key = (j["originatedFrom"], j["runId"], j["id"])
            assert key not in jobs, "a job twice in the plane"
            jobs[key] = j
        after = page.get("next")
        if after is None:
            return jobs


async def members_jobs(clusters: list[list[Node]]) -> dict[tuple[str, str, str], str]:
    jobs = {}
    for nodes in clusters:
        for j in await nodes[0].get("/v1/jobs?limit=10000"):
            jobs[(j["originatedFrom"], j["runId"], j["id"])] = j["state"]
    return jobs


async def test_two_clusters_in_one_fleet_view(tmp_path: Path, plane: PlaneProcess) -> None:
    async with AsyncExitStack() as stack:
        clusters = await two_clusters(tmp_path, plane, stack)
        for nodes in clusters:
            for n, node in enumerate(nodes):
                origin = await node.node_id()
                for wid in range(3):
                    for seq in range(1, 2 + (wid + n) % 3):
                        await node.enter(str(wid), seq, origin)

        async def synced() -> bool:
            theirs = {k: j["state"] for k, j in (await plane_jobs(plane)).items()}
            return theirs == await members_jobs(clusters)

        await eventually(synced, "the plane holds every job in its final state")
        fleet = json.loads(await plane.cli("fleet", "--json"))
        by_name = {c["name"]: c for c in fleet["clusters"]}
        assert set(by_name) == {"east", "west"}
        for cname, nodes in zip(("east", "west"), clusters, strict=True):
            members = await nodes[0].get("/v1/nodes")
            gpus: dict[str, int] = {}
            for node in members:
                for device in node["devices"]:
                    gpus[device["deviceClass"]] = gpus.get(device["deviceClass"], 0) + 1
            assert {cls: sum(h.values()) for cls, h in by_name[cname]["gpus"].items()} == gpus
            assert by_name[cname]["nodes"]["reachable"] == len(nodes)
            states: dict[str, int] = {}
            for j in await nodes[0].get("/v1/jobs?limit=10000"):
                states[j["state"]] = states.get(j["state"], 0) + 1
            assert by_name[cname]["jobs"]["byState"] == states
        text = await plane.cli("fleet")
        assert "east (clu_" in text
        assert "h100-80gb-sxm: 8" in text
        west = by_name["west"]["id"]
        assert "revoked" in await plane.cli("revoke", west)
        listed = {c["id"]: c for c in await plane.get("/v1/clusters")}
        assert listed[west]["revokedAt"] is not None
