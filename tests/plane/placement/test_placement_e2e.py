"""Issue 16 end to end, through the plane's API only: a real plane process on a real
PostgreSQL and two enrolled clusters of real agents with simulated GPUs and mock engines,
whose capacity the plane knows only from their signed syncs.

A workload that fits is split across the clusters as the apportionment says and its replicas
come up and are reported back; a scale change moves only the delta; a one-domain TP-4
workload never goes where no domain has 4 free devices; a workload past its project's quota
is refused naming the quota; a workload on load is declared in each cluster with its shares
as bounds, scales from zero in the cluster that gets a request, and the plane hears of the
scale-up and the cold start; a tenant cannot read or change another tenant's objects."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from plane.placement.apportion import apportion, scale_up
from tests.agent.deploy_harness import kill_engines
from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.workload_manager.cluster_harness import engine_ports

from ..plane_process import ADMIN, PlaneProcess, point_at_plane

pytestmark = pytest.mark.asyncio(loop_scope="module")

H100, L4 = "h100-80gb-sxm", "l4"
# east: one NVLink domain of 4 H100s and 2 L4s; west: 4 H100s in two domains of 2, 1 L4.
GPUS = {"east": f"{H100}:4,{L4}:2", "west": f"{H100}:2,{H100}:2,{L4}:1"}


@dataclass
class Fleet:
    plane: PlaneProcess
    clusters: dict[str, tuple[str, Node]]  # name -> (clu_ id, its one node)
    key: str  # acme's tenant key
    other_key: str  # another tenant's
    project: str
    artifact: str

    async def call(
        self, method: str, path: str, body: Any = None, *, token: str = ADMIN
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.plane.url + path, json=body, headers=headers) as r,
        ):
            return r.status, await r.json()

    async def ok(self, method: str, path: str, body: Any = None, *, token: str = ADMIN) -> Any:
        status, answer = await self.call(method, path, body, token=token)
        assert status in (200, 201), (status, answer)
        return answer

    def cluster_name(self, clu: str) -> str:
        return next(name for name, (cid, _) in self.clusters.items() if cid == clu)

    async def ready(self, workload: str) -> dict[str, int]:
        """Ready replicas by cluster name, as the plane's deployments view says."""
        rows = await self.ok("GET", f"/v1/deployments?workload={workload}", token=self.key)
        return {d["clusterName"]: d["ready"] for d in rows["items"]}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet(pg_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    name = f"test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    plane = PlaneProcess(pg_server.rsplit("/", 1)[0] + "/" + name)
    await plane.start()
    root = tmp_path_factory.mktemp("placement-e2e")
    clusters: dict[str, tuple[str, Node]] = {}
    generators = []
    try:
        for cname in ("east", "west"):
            token = (await plane.cli("enrol-cluster", cname)).strip()
            node = make_node(root / cname, f"{cname}1", GPUS[cname])
            point_at_plane(node.home, plane, token)
            low, high = engine_ports()
            (node.home / "nvpair.toml").write_text(
                f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
            )
            generator = start_cluster([node])
            generators.append((generator, node))
            (started,) = await generator.__anext__()
            (clu,) = {c["id"] for c in await plane.get("/v1/clusters") if c["name"] == cname}
            clusters[cname] = (clu, started)
        fleet = Fleet(plane, clusters, "", "", "", "")
        acme = await fleet.ok("POST", "/v1/tenants", {"name": "acme"})
        other = await fleet.ok("POST", "/v1/tenants", {"name": "other"})
        fleet.key = (await fleet.ok("POST", f"/v1/tenants/{acme['id']}/keys", {}))["key"]
        fleet.other_key = (await fleet.ok("POST", f"/v1/tenants/{other['id']}/keys", {}))["key"]
        # The tenant makes its own project and artifact; only the admin sets its quota.
        fleet.project = (await fleet.ok("POST", "/v1/projects", {"name": "p"}, token=fleet.key))[
            "id"
        ]
        artifact = {"digest": "sha256:" + "ab" * 32, "kind": "base", "locations": ["/w/m"]}
        fleet.artifact = (await fleet.ok("POST", "/v1/artifacts", artifact, token=fleet.key))["id"]
        quota = {"projectId": fleet.project, "deviceClass": H100, "maxDevices": 4}
        await fleet.ok("POST", "/v1/quotas", quota)

        async def synced() -> bool:  # both clusters' devices are in the plane
            summary = await plane.get("/v1/fleet/summary")
            return len([c for c in summary["clusters"] if c["gpus"]]) == 2

        await eventually(synced, "both clusters' GPUs synced into the plane")
        yield fleet
    finally:
        for generator, node in generators:
            with contextlib.suppress(StopAsyncIteration):
                await generator.__anext__()
            kill_engines(node.home)
        await plane.stop()
        async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


def _workload(
    fleet: Fleet, name: str, cls: str, gpus: int, replicas: int, **constraints: Any
) -> Any:
    return {
        "name": name,
        "project": fleet.project,
        "artifact": fleet.artifact,
        "serving": {"engine": "mock", "gpus": gpus, "tp": gpus},
        "replicas": replicas,
        "maxReplicas": 8,
        "constraints": {"deviceClass": cls, **constraints},
    }


async def _explain(fleet: Fleet, name: str) -> dict[str, Any]:
    answer: dict[str, Any] = await fleet.ok("GET", f"/v1/workloads/{name}/explain", token=fleet.key)
    return answer


async def test_a_workload_is_split_as_apportioned_and_a_scale_moves_only_the_delta(
    fleet: Fleet,
) -> None:
    placed = await fleet.ok(
        "POST", "/v1/workloads", _workload(fleet, "chat", L4, 1, 2), token=fleet.key
    )
    explained = await _explain(fleet, "chat")
    # What each cluster had room for, and the split Webster gives over it.
    room = {c["cluster"]: c["share"] + c["available"] for c in explained["clusters"]}
    assert room == {fleet.clusters["east"][0]: 2, fleet.clusters["west"][0]: 1}
    shares = explained["shares"]
    assert shares == apportion(2, room, room) == dict.fromkeys(room, 1), placed
    await eventually(
        lambda: _equals(fleet.ready("chat"), {"east": 1, "west": 1}),
        "one ready chat replica per cluster, reported back to the plane",
    )
    east_node, west_node = fleet.clusters["east"][1], fleet.clusters["west"][1]
    west_before = await _version(west_node, "chat")

    # Scale 2 -> 3: the added replica goes where there is room left (east); west's share,
    # its plane row and its cluster's declared version stay exactly as they were.
    remaining = {c["cluster"]: c["available"] for c in explained["clusters"]}
    await fleet.ok("PATCH", "/v1/workloads/chat", {"replicas": 3}, token=fleet.key)
    after = (await _explain(fleet, "chat"))["shares"]
    assert (
        after
        == scale_up(shares, 1, remaining)
        == {
            fleet.clusters["east"][0]: 2,
            fleet.clusters["west"][0]: 1,
        }
    )
    await eventually(
        lambda: _equals(fleet.ready("chat"), {"east": 2, "west": 1}),
        "east runs the added replica",
    )
    assert await _version(west_node, "chat") == west_before
    assert (await _version(east_node, "chat")) is not None


async def test_one_domain_tp4_goes_only_where_a_domain_has_four_free(fleet: Fleet) -> None:
    # West has 4 free H100s, but in two NVLink domains of 2 (the control: the devices are
    # there, as the fleet view says); only east has a domain of 4.
    west = next(
        c for c in (await fleet.plane.get("/v1/fleet/summary"))["clusters"] if c["name"] == "west"
    )
    assert west["gpus"][H100] == {"ok": 4}
    body = _workload(fleet, "big", H100, 4, 1, oneDomain=True)
    await fleet.ok("POST", "/v1/workloads", body, token=fleet.key)
    explained = await _explain(fleet, "big")
    verdicts = {fleet.cluster_name(c["cluster"]): c for c in explained["clusters"]}
    assert verdicts["east"]["share"] == 1
    assert verdicts["west"]["share"] == 0
    assert verdicts["west"]["refusedBy"] == "constraints.oneDomain", verdicts["west"]
    await eventually(
        lambda: _equals(fleet.ready("big"), {"east": 1}), "the TP-4 replica is ready on east"
    )

    # The quota (4 H100s fleet-wide) is now used up: the next H100 workload is refused,
    # naming the quota, and nothing of it is stored.
    status, answer = await fleet.call(
        "POST", "/v1/workloads", _workload(fleet, "more", H100, 1, 1), token=fleet.key
    )
    assert status == 409, answer
    quotas = await fleet.ok("GET", "/v1/quotas", token=fleet.key)
    (quota,) = quotas["items"]
    assert quota["id"] in answer["error"], answer
    assert H100 in answer["error"], answer
    status, _ = await fleet.call("GET", "/v1/workloads/more", token=fleet.key)
    assert status == 404


async def test_a_workload_on_load_scales_from_zero_in_its_cluster_and_the_plane_hears(
    fleet: Fleet,
) -> None:
    body = {
        "name": "lazy", "project": fleet.project, "artifact": fleet.artifact,
        "serving": {"engine": "mock", "gpus": 0}, "onLoad": True, "minReplicas": 0,
        "maxReplicas": 2,
    }  # fmt: skip
    placed = await fleet.ok("POST", "/v1/workloads", body, token=fleet.key)
    assert placed["replicas"] == 2  # placed at its max: one per cluster
    (east_clu, east), (west_clu, west) = fleet.clusters["east"], fleet.clusters["west"]
    assert {d["cluster"]: d["replicas"] for d in placed["deployments"]} == {
        east_clu: 1, west_clu: 1,
    }  # fmt: skip

    async def bounded(node: Node) -> bool:  # each cluster: its shares as bounds, at zero
        held = {d["name"]: d for d in await node.get("/v1/deployments")}.get("lazy")
        return bool(held and held["elastic"] and (held["elastic"]["min"], held["elastic"]["max"],
                    held["replicas"]) == (0, 1, 0))  # fmt: skip

    for node in (east, west):
        await eventually(lambda n=node: bounded(n), f"{node.name} declares lazy 0..1 at zero")
    url = f"http://127.0.0.1:{east.ports['facade']}/v1/chat/completions"
    ask = {"model": "lazy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session, session.post(url, json=ask) as answer:
        assert answer.status == 200, await answer.text()
    east_held = {d["name"]: d for d in await east.get("/v1/deployments")}["lazy"]
    assert (east_held["replicas"], east_held["elastic"]["reason"]) == (1, "waiting")
    assert await bounded(west)  # the control: west had no request, it stays at zero

    async def heard() -> bool:  # east's decider tells the plane of its scale-up and cold start
        rows = (await fleet.ok("GET", f"/v1/events?cluster={east_clu}"))["items"]
        told = {(e["kind"], e["about"]) for e in rows}
        return {("scale-up", "lazy"), ("cold-start", "lazy")} <= told

    await eventually(heard, "the plane lists lazy's scale-up and cold start")
    assert (await fleet.ok("GET", "/v1/workloads/lazy", token=fleet.key))["replicas"] == 2
    await fleet.ok("DELETE", "/v1/workloads/lazy", token=fleet.key)


async def test_a_tenant_cannot_read_or_change_another_tenants_objects(fleet: Fleet) -> None:
    # The control first: acme reads and changes its own.
    mine = await fleet.ok("GET", "/v1/workloads/chat", token=fleet.key)
    other = fleet.other_key
    for method, path, body in (
        ("GET", f"/v1/workloads/{mine['id']}", None),
        ("GET", f"/v1/workloads/{mine['id']}/explain", None),
        ("PATCH", f"/v1/workloads/{mine['id']}", {"replicas": 0}),
        ("DELETE", f"/v1/workloads/{mine['id']}", None),
        ("GET", f"/v1/projects/{fleet.project}", None),
        ("DELETE", f"/v1/artifacts/{fleet.artifact}", None),
    ):
        status, answer = await fleet.call(method, path, body, token=other)
        assert status == 404, (method, path, status, answer)
    assert (await fleet.ok("GET", "/v1/workloads", token=other))["items"] == []
    assert (await fleet.ok("GET", "/v1/deployments", token=other))["items"] == []
    # Nothing changed: chat still has its 3 replicas.
    assert (await fleet.ok("GET", "/v1/workloads/chat", token=fleet.key))["replicas"] == 3


async def _equals(got: Any, want: Any) -> bool:
    return bool(await got == want)


async def _version(node: Node, name: str) -> int | None:
    held = {d["name"]: d for d in await node.get("/v1/deployments")}.get(name)
    return None if held is None else int(held["version"])
