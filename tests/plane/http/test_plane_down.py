"""Deployments down, replicas up (issue 16, item 4) with a real plane process on a real
PostgreSQL and two clusters of real agents running mock engines: deployment rows placed on
each cluster come up there and are reported back ready; a scale changes only that cluster;
a deleted row is undeployed; the desired state outlives a plane outage and an agent restart;
an observed deployment adopts a running engine without restarting it and reports drift."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import pytest_asyncio

from tests.agent.deploy_harness import alive, kill_engines
from tests.agent.harness import Node, eventually, make_node, start_cluster, start_engine
from tests.workload_manager.cluster_harness import engine_ports

from .. import demand_rows
from ..plane_process import PlaneProcess, point_at_plane

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Fleet:
    plane: PlaneProcess
    dsn: str
    clusters: dict[str, tuple[str, list[Node]]]  # name -> (clu_ id, nodes)
    project: str

    async def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(query.encode(), params)
            return await cur.fetchall() if cur.description else []

    async def plane_deployments(self, name: str) -> dict[str, dict[str, Any]]:
        rows = (await self.plane.get(f"/v1/deployments?workload={name}"))["items"]
        return {d["clusterName"]: d for d in rows}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(pg_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    name = f"test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    dsn = pg_server.rsplit("/", 1)[0] + "/" + name
    plane = PlaneProcess(dsn)
    await plane.start()
    root = tmp_path_factory.mktemp("plane-down")
    clusters: dict[str, tuple[str, list[Node]]] = {}
    generators = []
    try:
        for cname, names in (("east", ["e1", "e2"]), ("west", ["w1"])):
            token = (await plane.cli("enrol-cluster", cname)).strip()
            nodes = [make_node(root / cname, n, None) for n in names]
            for node in nodes:
                point_at_plane(node.home, plane, token)
                low, high = engine_ports()
                (node.home / "nvpair.toml").write_text(
                    f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
                )
            generator = start_cluster(nodes)
            generators.append((generator, nodes))
            started = await generator.__anext__()
            (clu,) = {c["id"] for c in await plane.get("/v1/clusters") if c["name"] == cname}
            clusters[cname] = (clu, started)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            _, project, _ = await demand_rows.tenant(conn, "acme")
        yield Fleet(plane, dsn, clusters, project)
    finally:
        for generator, nodes in generators:
            with contextlib.suppress(StopAsyncIteration):
                await generator.__anext__()
            for node in nodes:
                kill_engines(node.home)
        await plane.stop()
        async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


async def _declared(node: Node, name: str) -> dict[str, Any] | None:
    return {d["name"]: d for d in await node.get("/v1/deployments")}.get(name)


async def _ready(nodes: list[Node], name: str) -> int:
    """Ready replicas of `name` as the cluster's first member sees them (0 while any
    member's view differs)."""
    views = []
    for node in nodes:
        views.append(
            sorted(
                r["id"]
                for r in await node.get("/v1/replicas")
                if r["deployment"] == name and r["state"] == "ready"
            )
        )
    return len(views[0]) if all(v == views[0] for v in views) else -1


async def test_placed_deployments_come_up_scale_and_go_per_cluster(fleet: Fleet) -> None:
    east_id, east = fleet.clusters["east"]
    west_id, west = fleet.clusters["west"]
    async with await psycopg.AsyncConnection.connect(fleet.dsn, autocommit=True) as conn:
        chat = await demand_rows.workload(
            conn, fleet.project, "chat", serving={"engine": "mock", "gpus": 0}
        )
        on_east = await demand_rows.deployment(conn, chat, east_id, 2)
        on_west = await demand_rows.deployment(conn, chat, west_id, 1)

    async def reported(east_n: int, west_n: int) -> bool:
        seen = await fleet.plane_deployments("chat")
        return (seen.get("east", {}).get("ready"), seen.get("west", {}).get("ready")) == (
            east_n,
            west_n,
        )

    await eventually(lambda: reported(2, 1), "the plane sees 2 ready on east, 1 on west")
    # The plane hears each node's replicas from that node's own sync; the members hear each
    # other's from the records' deltas, which may be a beat behind.
    await eventually(lambda: _ready_count(east, "chat", 2), "every east member sees 2 ready")
    await eventually(lambda: _ready_count(west, "chat", 1), "west sees 1 ready")
    for node, dep in ((east[0], on_east), (east[1], on_east), (west[0], on_west)):
        held = await _declared(node, "chat")
        assert held is not None
        assert held["id"] == dep  # declared under the plane's id
    # Two members converged at once: one version, the same on both.
    first, second = await _declared(east[0], "chat"), await _declared(east[1], "chat")
    assert first == second
    west_version = (await _declared(west[0], "chat"))["version"]  # type: ignore[index]

    # Scale east's row: only east changes.
    await fleet.sql("UPDATE deployments SET replicas = 3 WHERE id = %s", (on_east,))
    await fleet.sql(
        "UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = %s", (east_id,)
    )
    await eventually(lambda: reported(3, 1), "east scaled to 3 in the plane's view")
    assert (await _declared(west[0], "chat"))["version"] == west_version  # type: ignore[index]

    # Delete west's row: west undeploys it, east keeps its three.
    await fleet.sql("DELETE FROM deployments WHERE id = %s", (on_west,))

    async def gone_from_west() -> bool:
        return await _declared(west[0], "chat") is None and await _ready(west, "chat") == 0

    await eventually(gone_from_west, "west undeployed chat")
    assert await _ready(east, "chat") == 3


async def test_the_desired_state_outlives_a_plane_outage_and_an_agent_restart(
    fleet: Fleet,
) -> None:
    east_id, east = fleet.clusters["east"]
    async with await psycopg.AsyncConnection.connect(fleet.dsn, autocommit=True) as conn:
        wkl = await demand_rows.workload(
            conn, fleet.project, "kept", serving={"engine": "mock", "gpus": 0}
        )
        await demand_rows.deployment(conn, wkl, east_id, 1)
    await eventually(lambda: _ready_count(east, "kept", 1), "kept runs on east")
    await fleet.plane.stop()
    try:
        e2 = east[1]
        await e2.stop()
        await e2.start()
        assert await _declared(e2, "kept") is not None  # from its own stores
        await eventually(lambda: _ready_count(east, "kept", 1), "kept still runs, plane away")
        status = await e2.get("/v1/plane")
        assert status["desired"] is not None  # the persisted one, the plane being away
        assert "kept" in {d["name"] for d in status["desired"]["deployments"]}

        async def fetch_failing() -> bool:
            return await e2.metric("nvpair_plane_desired_failures") > 0

        await eventually(fetch_failing, "the failed fetches are counted")
    finally:
        await fleet.plane.start()


async def _ready_count(nodes: list[Node], name: str, count: int) -> bool:
    return await _ready(nodes, name) == count


async def test_an_observed_deployment_adopts_a_running_engine_and_reports_drift(
    fleet: Fleet,
) -> None:
    west_id, _west = fleet.clusters["west"]
    engine = await start_engine("adopted")
    try:
        async with await psycopg.AsyncConnection.connect(fleet.dsn, autocommit=True) as conn:
            for name in ("adopted", "mislabel"):
                wkl = await demand_rows.workload(
                    conn, fleet.project, name, serving={"engine": "mock", "gpus": 0}
                )
                await demand_rows.deployment(
                    conn, wkl, west_id, 1, authority="observed", url=engine.url, node="w1"
                )

        async def seen(name: str, drift: list[str]) -> bool:
            got = (await fleet.plane_deployments(name)).get("west", {})
            return got.get("ready") == 1 and got.get("drift") == drift

        await eventually(lambda: seen("adopted", []), "the adopted engine ready, no drift")
        await eventually(
            lambda: seen("mislabel", ["the engine serves adopted, not mislabel"]),
            "drift reported where the engine serves another model",
        )
        assert alive(engine.proc.pid)
        assert engine.proc.returncode is None  # the same process: never restarted
        await engine.stop()
        await eventually(
            lambda: _drift_is(fleet, "adopted", "the engine does not answer"),
            "an engine that stopped answering is drift too",
        )
    finally:
        await engine.stop()


async def _drift_is(fleet: Fleet, name: str, drift: str) -> bool:
    return (await fleet.plane_deployments(name)).get("west", {}).get("drift") == [drift]
