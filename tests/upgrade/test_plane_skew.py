"""The plane and the agents one release apart (issue 27, item 4): an agent of the previous
release enrolled with a plane of this one, and an agent of this release with a plane of
the previous one. Each way the sync carries the cluster up (GPUs, every lifecycle event
the client was told of, exactly) and the desired state comes down (a workload placed by
the plane runs on the cluster and is reported ready)."""

from __future__ import annotations

import random
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import psycopg
import pytest

from tests.agent.deploy_harness import kill_engines
from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.plane.plane_process import ADMIN, PlaneProcess, point_at_plane
from tests.reliability.cluster import Member
from tests.reliability.ledger import RememberingClient
from tests.reliability.plane import plane_divergence, postgres
from tests.workload_manager.cluster_harness import engine_ports

from .previous import Previous

pytestmark = pytest.mark.asyncio(loop_scope="function")

L4 = "l4"


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """One throw-away PostgreSQL for the module; each direction takes a fresh database."""
    with postgres() as dsn:
        yield dsn


async def _ok(
    plane: PlaneProcess, method: str, path: str, body: Any = None, token: str = ADMIN
) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, plane.url + path, json=body, headers=headers) as response,
    ):
        answer = await response.json()
        assert response.status in (200, 201), (response.status, answer)
        return answer


@pytest.mark.parametrize("plane_of", ["this", "previous"])
async def test_a_plane_and_an_agent_one_release_apart(
    plane_of: str,
    previous: Previous,
    pg_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    plane_python = sys.executable if plane_of == "this" else previous.python
    agent_python = previous.python if plane_of == "this" else sys.executable
    name = f"skew_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    plane = PlaneProcess(pg_server.rsplit("/", 1)[0] + "/" + name, python=plane_python)
    await plane.start()
    root = tmp_path_factory.mktemp(f"plane-{plane_of}")
    node = make_node(root, "a", f"{L4}:2")
    node.python = agent_python
    try:
        token = (await plane.cli("enrol-cluster", "lab")).strip()
        point_at_plane(node.home, plane, token)
        low, high = engine_ports()
        (node.home / "nvpair.toml").write_text(
            f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
        )
        async for (started,) in start_cluster([node]):
            await _both_ways(plane, started, plane_of)
    finally:
        kill_engines(node.home)
        await plane.stop()
        async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


async def _both_ways(plane: PlaneProcess, node: Node, plane_of: str) -> None:
    (cluster,) = {c["id"] for c in await plane.get("/v1/clusters") if c["name"] == "lab"}

    async def gpus_up() -> bool:
        summary = await plane.get("/v1/fleet/summary")
        return any(c["gpus"] for c in summary["clusters"])

    await eventually(gpus_up, "the cluster's GPUs synced into the plane")
    # Up: lifecycle events, exactly what the client was told.
    member = Member(node, {}, node_id=await node.node_id())
    async with RememberingClient(random.Random(4)) as ledger:
        await ledger.load([member], jobs=30, rate_per_s=40, prefix="skew")
        await ledger.wait_converged([member])
        seen: list[Any] = []

        async def plane_has_them() -> bool:
            seen[:] = [plane_divergence(ledger, await _plane_jobs(plane, cluster))]
            return not seen[0]

        await eventually(plane_has_them, "the plane holds what the client was told")
    # Down: a workload the plane places runs on the cluster and is reported ready.
    tenant = await _ok(plane, "POST", "/v1/tenants", {"name": "acme"})
    key = (await _ok(plane, "POST", f"/v1/tenants/{tenant['id']}/keys", {}))["key"]
    project = (await _ok(plane, "POST", "/v1/projects", {"name": "p"}, key))["id"]
    artifact = {"digest": "sha256:" + "cd" * 32, "kind": "base", "locations": ["/w/m"]}
    artifact_id = (await _ok(plane, "POST", "/v1/artifacts", artifact, key))["id"]
    workload = {
        "name": "chat",
        "project": project,
        "artifact": artifact_id,
        "serving": {"engine": "mock", "gpus": 1, "tp": 1},
        "replicas": 1,
        "maxReplicas": 2,
        "constraints": {"deviceClass": L4},
    }
    await _ok(plane, "POST", "/v1/workloads", workload, key)

    async def ready() -> bool:
        rows = await _ok(plane, "GET", "/v1/deployments?workload=chat", None, key)
        return [d["ready"] for d in rows["items"]] == [1]

    await eventually(ready, "the placed workload is ready in the plane's view", within_s=60)
    shown = {d["name"]: d.get("replicaStates") for d in await node.get("/v1/deployments")}
    assert any(states == {"ready": 1} for states in shown.values()), shown
    served, syncing = ("this", "the previous") if plane_of == "this" else ("the previous", "this")
    print(
        f"a plane of {served} release, an agent of {syncing}: "
        f"{ledger.figures.accepted} events synced exactly, a placed workload ready"
    )


async def _plane_jobs(plane: PlaneProcess, cluster: str) -> dict[Any, tuple[int, str]]:
    listed: dict[Any, tuple[int, str]] = {}
    path = f"/v1/jobs?cluster={cluster}&limit=1000"
    while True:
        page = await plane.get(path)
        for job in page["jobs"]:
            listed[(job["originatedFrom"], job["runId"], job["id"])] = (
                int(job["seq"]),
                job["state"],
            )
        if "next" not in page:
            return listed
        path = f"/v1/jobs?cluster={cluster}&limit=1000&after={page['next']}"
