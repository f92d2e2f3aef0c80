"""Plane operations, events, components and the cache against a real plane HTTP server on a
real PostgreSQL (issue 16, item 6): who may start what, phases that only move forward, the
one-writer rules of what nodes report, replays that insert nothing, the events' retention
bound, and residency against the declared warm set."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.config import PlaneSettings
from agent.plane_link.events import machinery_reporters
from agent.plane_link.sync import PlaneSync
from broker.jobs import JobsStore, JobsWriter
from plane.core.errors import BadInput
from plane.core.ids import new_id
from plane.core.tenant_keys import mint_tenant_key
from plane.core.tokens import hash_token
from plane.core.wire import NodeSummary, SyncBatch
from plane.db.connection import Conn
from plane.desired.state import (
    CacheReport,
    ComponentReport,
    DesiredState,
    EventReport,
    OperationReport,
)
from plane.http.server import PlaneServer
from plane.machinery import sync as sync_machinery
from plane.machinery.sql import pending_operations, warm_set
from plane.placement import workload_ops
from tests.fixtures.operations_node import OperationsNode
from tests.fixtures.records import node_record
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import free_port

from ..plane_client import ADMIN, Plane, enrol

JSON = {"headers": {"Content-Type": "application/json"}}


def batch(node: str, generation: int = 1, **fields: Any) -> SyncBatch:
    """A node's batch with its own row and the machinery fields given."""
    return SyncBatch(
        nodeId=node, generation=generation, node=NodeSummary(name=node[-6:], version="1.0"),
        **fields,
    )  # fmt: skip


async def sync(plane: Plane, token: str, sent: SyncBatch) -> tuple[int, Any]:
    """POST the batch signed by the node it names."""
    return await plane.call("POST", "/v1/sync", token, msgspec.json.encode(sent), **JSON)


async def sql(plane: Plane, query: str, *args: Any) -> list[tuple[Any, ...]]:
    async with plane.store.pool.connection() as conn:
        cursor = await conn.execute(query.encode(), args)
        return await cursor.fetchall() if cursor.description else []


async def tenant(plane: Plane, name: str) -> tuple[str, str, str, str]:
    """A tenant with a key, a project, an artifact and a workload: (ten, key, art, wkl)."""
    ten, prj, art, wkl = (new_id(p) for p in ("ten", "prj", "art", "wkl"))
    key = mint_tenant_key()
    await sql(plane, "INSERT INTO tenants (id, name) VALUES (%s, %s)", ten, name)
    await sql(
        plane, "INSERT INTO tenant_keys (hash, tenant_id) VALUES (%s, %s)", hash_token(key), ten
    )
    await sql(plane, "INSERT INTO projects (id, tenant_id, name) VALUES (%s, %s, 'p')", prj, ten)
    await sql(
        plane,
        "INSERT INTO artifacts (id, tenant_id, digest, kind, locations) "
        "VALUES (%s, %s, %s, 'weights', ARRAY['/nowhere/' || %s])",
        art, ten, f"sha256:{name}", name,
    )  # fmt: skip
    await sql(
        plane,
        "INSERT INTO workloads (id, project_id, artifact_id, serving_digest, serving, name, "
        "max_replicas) VALUES (%s, %s, %s, %s, '{}', %s, 4)",
        wkl, prj, art, "svg_" + "0" * 64, f"model-{name}",
    )  # fmt: skip
    return ten, key, art, wkl


async def operation(plane: Plane, token: str, **body: Any) -> tuple[int, Any]:
    return await plane.call("POST", "/v1/operations", token, body)


async def test_a_drain_is_its_target_clusters_and_moves_only_forward(plane: Plane) -> None:
    cluster, token = await enrol(plane, "lab")
    other_cluster, other_token = await enrol(plane, "other")
    node, neighbour = new_id("nod"), new_id("nod")
    for n in (node, neighbour):
        assert (await sync(plane, token, batch(n)))[0] == 200
    [(generation,)] = await sql(
        plane, "SELECT desired_generation FROM clusters WHERE id = %s", cluster
    )

    # Who may start one, and what a bad one is told (the field named).
    status, body = await operation(plane, token, kind="drain", target=node)
    assert status == 403, body  # a cluster token starts nothing
    assert (await operation(plane, ADMIN, kind="drain", target="nod_x"))[0] == 400
    status, body = await operation(plane, ADMIN, kind="drain", target=node, timeoutS=-1)
    assert status == 400, body
    assert "timeoutS" in body["error"], body
    assert (await operation(plane, ADMIN, kind="drain", target=new_id("nod")))[0] == 404

    status, op = await operation(
        plane, ADMIN, kind="drain", target=node, reason="kernel", force=True
    )
    assert status == 201, op
    assert (op["phase"], op["cluster"], op["requester"], op["force"]) == (
        "pending",
        cluster,
        "admin",
        True,
    )
    async with plane.store.pool.connection() as conn:
        [desired] = await pending_operations(conn, cluster)
        assert await pending_operations(conn, other_cluster) == []
    assert (desired.id, desired.kind, desired.target, desired.reason) == (
        op["id"],
        "drain",
        node,
        "kernel",
    )
    [(bumped,)] = await sql(plane, "SELECT desired_generation FROM clusters WHERE id = %s", cluster)
    assert bumped > generation

    # Only the target node moves its phase; another cluster does not even see it.
    report = [OperationReport(id=op["id"], phase="running")]
    forged = [OperationReport(id=op["id"], phase="succeeded", result="forged")]
    status, body = await sync(plane, token, batch(neighbour, 2, operations=forged))
    assert status == 200, body
    assert body["written"]["operations"] == 0  # not its operation: ignored
    _, seen = await plane.call("GET", f"/v1/operations/{op['id']}", ADMIN)
    assert seen["phase"] == "pending"
    assert (await plane.call("GET", f"/v1/operations/{op['id']}", other_token))[0] == 404
    assert (await sync(plane, token, batch(node, 2, operations=report)))[0] == 200
    done = [OperationReport(id=op["id"], phase="succeeded", result="drained: no job runs there")]
    assert (await sync(plane, token, batch(node, 3, operations=done)))[0] == 200
    status, body = await sync(plane, token, batch(node, 4, operations=report))  # stale
    assert status == 200
    assert body["written"]["operations"] == 0
    status, seen = await plane.call("GET", f"/v1/operations/{op['id']}", token)
    assert status == 200
    assert (seen["phase"], seen["result"]) == ("succeeded", done[0].result)
    async with plane.store.pool.connection() as conn:
        assert await pending_operations(conn, cluster) == []  # final: no longer asked for
    status, listed = await plane.call(
        "GET", f"/v1/operations?cluster={cluster}&phase=succeeded", ADMIN
    )
    assert [o["id"] for o in listed["items"]] == [op["id"]]
    status, listed = await plane.call("GET", f"/v1/operations?cluster={cluster}", other_token)
    assert status == 403


@pytest.fixture
def scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement's scale and pause stand-ins (plane.placement.workload_ops is the placement work's):
    they write first and refuse after, so a refusal must leave nothing behind."""

    async def scale(conn: Conn, workload_id: str, replicas: int) -> None:
        await conn.execute(
            "UPDATE workloads SET replicas = %s WHERE id = %s", (replicas, workload_id)
        )
        if replicas > 4:
            raise BadInput(f"replicas {replicas} is past the workload's max_replicas 4")

    async def pause(conn: Conn, workload_id: str, paused: bool) -> None:
        await conn.execute("UPDATE workloads SET paused = %s WHERE id = %s", (paused, workload_id))

    monkeypatch.setattr(workload_ops, "scale_workload", scale)
    monkeypatch.setattr(workload_ops, "pause_workload", pause)


async def test_tenants_scale_and_pause_their_own_workloads_only(
    plane: Plane, scaling: None
) -> None:
    ten, key, _, wkl = await tenant(plane, "acme")
    _, other_key, _, other_wkl = await tenant(plane, "globex")
    _, token = await enrol(plane, "lab")
    node = new_id("nod")
    assert (await sync(plane, token, batch(node)))[0] == 200

    status, op = await operation(plane, key, kind="scale", target=wkl, replicas=3)
    assert status == 201, op
    assert (op["phase"], op["requester"], op["tenant"]) == ("succeeded", ten, ten)
    status, op = await operation(plane, key, kind="scale", target=wkl, replicas=9)
    assert status == 201, op
    assert op["phase"] == "failed", op
    assert "max_replicas" in op["result"]
    assert await sql(plane, "SELECT replicas FROM workloads WHERE id = %s", wkl) == [(3,)]
    status, op = await operation(plane, key, kind="pause", target=wkl)
    assert status == 201
    assert op["phase"] == "succeeded"
    assert await sql(plane, "SELECT paused FROM workloads WHERE id = %s", wkl) == [(True,)]

    assert (await operation(plane, key, kind="scale", target=wkl))[0] == 400  # no replicas
    assert (await operation(plane, key, kind="resume", target=node))[0] == 400  # not a wkl_
    assert (await operation(plane, key, kind="cordon", target=node))[0] == 403  # admin's
    status, body = await operation(plane, other_key, kind="resume", target=wkl)
    assert status == 404, body  # another tenant's workload is as absent
    assert await sql(plane, "SELECT paused FROM workloads WHERE id = %s", wkl) == [(True,)]
    assert (await operation(plane, other_key, kind="resume", target=other_wkl))[0] == 201

    _, mine = await plane.call("GET", "/v1/operations", key)
    assert {o["target"] for o in mine["items"]} == {wkl}
    assert len(mine["items"]) == 3
    first = mine["items"][-1]["id"]
    assert (await plane.call("GET", f"/v1/operations/{first}", other_key))[0] == 404
    assert (await plane.call("GET", f"/v1/operations/{first}", ADMIN))[0] == 200
    _, every = await plane.call("GET", "/v1/operations", ADMIN)
    assert len(every["items"]) == 4


def event(kind: str = "replica-ready", at: int = 1_764_000_000_000) -> EventReport:
    return EventReport(id=new_id("evt"), kind=kind, about=new_id("rep"), message="m", at=at)


async def test_events_are_each_nodes_own_inserted_once_and_bounded(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, token = await enrol(plane, "lab")
    _, other_token = await enrol(plane, "other")
    node, neighbour = new_id("nod"), new_id("nod")
    sent = [event(at=1_764_000_000_000 + i) for i in range(3)]
    status, body = await sync(plane, token, batch(node, events=sent))
    assert status == 200
    assert body["written"]["events"] == 3
    status, body = await sync(plane, token, batch(node, events=sent))  # a replay
    assert status == 200
    assert body["written"]["events"] == 0
    forged = [
        msgspec.structs.replace(sent[0], message="forged"),
        event("device-failed", at=sent[2].at + 1),
    ]
    status, body = await sync(plane, token, batch(neighbour, events=forged))
    assert status == 200
    assert body["written"]["events"] == 1
    _, page = await plane.call("GET", f"/v1/events?cluster={cluster}", ADMIN)
    by_id = {e["id"]: e for e in page["items"]}
    assert (by_id[sent[0].id]["node"], by_id[sent[0].id]["message"]) == (node, "m")
    assert by_id[forged[1].id]["node"] == neighbour
    assert [e["id"] for e in page["items"][1:]] == [s.id for s in reversed(sent)]  # newest first
    _, failed = await plane.call("GET", "/v1/events?kind=device-failed&limit=5", token)
    assert [e["id"] for e in failed["items"]] == [forged[1].id]
    assert (await plane.call("GET", f"/v1/events?cluster={cluster}", other_token))[0] == 403
    tenant_key = (await tenant(plane, "acme"))[1]
    assert (await plane.call("GET", "/v1/events", tenant_key))[0] == 403

    monkeypatch.setattr(sync_machinery, "MAX_EVENTS_PER_CLUSTER", 5)
    newer = [event(at=1_765_000_000_000 + i) for i in range(3)]
    assert (await sync(plane, token, batch(node, 2, events=newer)))[0] == 200
    kept = await sql(plane, "SELECT id FROM events WHERE cluster_id = %s ORDER BY at", cluster)
    assert [k for (k,) in kept] == [sent[2].id, forged[1].id, *(e.id for e in newer)][-5:]


async def test_components_and_cache_replace_the_nodes_own_rows(plane: Plane) -> None:
    cluster, token = await enrol(plane, "lab")
    _, _, art, _ = await tenant(plane, "acme")
    _, _, cold, _ = await tenant(plane, "globex")
    node, neighbour = new_id("nod"), new_id("nod")
    agent = ComponentReport(name="agent", version="1.0")
    engine = ComponentReport(name="engine:vllm:llama", version="0.6.1")
    assert (await sync(plane, token, batch(node, 1, components=[agent, engine])))[0] == 200
    assert (await sync(plane, token, batch(neighbour, 1, components=[agent, engine])))[0] == 200
    newer = ComponentReport(name="agent", version="1.1")
    assert (await sync(plane, token, batch(node, 3, components=[newer])))[0] == 200
    assert (await sync(plane, token, batch(node, 2, components=[agent, engine])))[0] == 200  # stale
    _, listed = await plane.call("GET", f"/v1/components?node={node}", ADMIN)
    assert [(c["name"], c["version"]) for c in listed["items"]] == [("agent", "1.1")]
    _, listed = await plane.call("GET", f"/v1/components?cluster={cluster}", token)
    assert len(listed["items"]) == 3  # the neighbour's two are its own

    status, body = await plane.call(
        "PUT", f"/v1/clusters/{cluster}/warm", token, {"artifacts": [art]}
    )
    assert status == 403, body
    status, body = await plane.call(
        "PUT", f"/v1/clusters/{cluster}/warm", ADMIN, {"artifacts": [new_id("art")]}
    )
    assert status == 404, body
    status, body = await plane.call(
        "PUT", f"/v1/clusters/{cluster}/warm", ADMIN, {"artifacts": ["x"]}
    )
    assert status == 400, body
    assert "artifacts" in body["error"], body
    status, body = await plane.call(
        "PUT", f"/v1/clusters/{cluster}/warm", ADMIN, {"artifacts": [art]}
    )
    assert status == 200, body
    assert body["artifacts"] == [art], body
    async with plane.store.pool.connection() as conn:
        assert [w.artifact for w in await warm_set(conn, cluster)] == [art]

    reports = [CacheReport(artifact=art, resident=True), CacheReport(artifact=cold, resident=True)]
    assert (await sync(plane, token, batch(node, 4, cache=reports)))[0] == 200
    _, cache = await plane.call("GET", f"/v1/cache?cluster={cluster}", ADMIN)
    entries = {e["artifact"]: e for e in cache["items"]}
    assert entries[art] == {
        "cluster": cluster, "artifact": art, "declaredWarm": True,
        "residentOn": [node], "fetchingOn": [], "missingOn": [neighbour],
    }  # fmt: skip
    # The neighbour fetching it (a node of 0.2.0 says how far): neither resident nor missing.
    fetching = CacheReport(artifact=art, resident=False, state="fetching", progress=0.4)
    assert (await sync(plane, token, batch(neighbour, 4, cache=[fetching])))[0] == 200
    _, cache = await plane.call("GET", f"/v1/cache?cluster={cluster}", ADMIN)
    entries = {e["artifact"]: e for e in cache["items"]}
    assert entries[art]["fetchingOn"] == [{"node": neighbour, "progress": 0.4}]
    assert entries[art]["missingOn"] == []
    assert (await sync(plane, token, batch(neighbour, 5, cache=[])))[0] == 200  # dropped again
    assert entries[cold]["declaredWarm"] is False
    assert "missingOn" not in entries[cold]
    unknown = CacheReport(artifact=new_id("art"), resident=True)  # one the plane never declared
    assert (await sync(plane, token, batch(node, 5, cache=[unknown])))[0] == 200
    _, cache = await plane.call("GET", "/v1/cache", token)
    assert [(e["artifact"], e["residentOn"]) for e in cache["items"]] == [(art, [])]


async def test_a_drain_from_the_plane_is_carried_out_and_reported_back(
    plane: Plane, tmp_path: Path
) -> None:
    """The whole loop in one process: the plane's pending operation handed to the target
    node's handler as its desired state (what `GET /v1/desired` carries), the node's real
    `Operations` draining, its real `PlaneSync` reporting the phase back, signed."""
    cluster, token = await enrol(plane, "lab")
    node = new_id("nod")
    port = free_port()
    server = PlaneServer(plane.store, host="127.0.0.1", port=port)
    await server.start()
    here = OperationsNode(node)
    here.jobs = ["job-1"]
    store = await JobsStore.open(tmp_path / "jobs.db")
    async with JobsWriter(store) as writer:
        reporters, handlers = machinery_reporters(
            here.operations, lambda _: None, home=tmp_path, node_id=node, plane_url=plane.url
        )
        sync = PlaneSync(
            PlaneSettings(url=f"http://127.0.0.1:{port}", token=token),
            identity=plane.ca(token).node(node), store=store, writer=writer,
            record=lambda: node_record(node), sleep=lambda _: asyncio.sleep(0.02),
            reporters=reporters,
        )  # fmt: skip
        running = asyncio.create_task(sync.run())
        try:

            async def synced() -> bool:
                return bool(await sql(plane, "SELECT 1 FROM nodes WHERE id = %s", node))

            await eventually(synced, "the node's first sync")
            _, op = await operation(plane, ADMIN, kind="drain", target=node, reason="swap")
            async with plane.store.pool.connection() as conn:
                state = DesiredState(
                    cluster=cluster, generation=2,
                    operations=await pending_operations(conn, cluster),
                )  # fmt: skip
            for handle in handlers:
                await handle(state)

            async def phase() -> str:
                return str(
                    (await plane.call("GET", f"/v1/operations/{op['id']}", ADMIN))[1]["phase"]
                )

            await eventually(lambda: _is(phase(), "running"), "the plane seeing it running")
            here.jobs = []
            await eventually(lambda: _is(phase(), "succeeded"), "the plane seeing it done")
            assert here.cordons == [True]
            _, joined = await plane.call("GET", "/v1/events?kind=node-joined", ADMIN)
            assert [e["about"] for e in joined["items"]] == [node]
        finally:
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            await server.aclose()
    await store.close()


async def _is(value: Any, wanted: str) -> bool:
    return bool(await value == wanted)
