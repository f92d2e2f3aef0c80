"""`GET /v1/desired`, `GET/POST /v1/deployments` and the replicas a node syncs up, against a
real plane on a real PostgreSQL (in-process)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from certs.ids import new_node_id
from plane.core.ids import new_id
from plane.core.wire import NodeSummary, SyncBatch
from plane.desired.state import ReplicaReport

from .. import demand_rows
from ..plane_client import ADMIN, Plane, enrol


async def _rows(plane: Plane) -> dict[str, Any]:
    east, east_token = await enrol(plane, "east")
    west, west_token = await enrol(plane, "west")
    async with plane.store.pool.connection() as conn:
        ten, prj, key = await demand_rows.tenant(conn, "acme")
        _, other_prj, other_key = await demand_rows.tenant(conn, "globex")
        chat = await demand_rows.workload(
            conn,
            prj,
            "chat",
            serving={"engine": "vllm", "gpus": 2, "tp": 2, "args": ["--x"], "maxInFlight": 8},
            source="s3://weights/chat",
            constraints={"deviceClass": "h100-80gb-sxm", "oneDomain": True},
        )
        theirs = await demand_rows.workload(conn, other_prj, "theirs")
        chat_east = await demand_rows.deployment(conn, chat, east, 2)
        chat_west = await demand_rows.deployment(conn, chat, west, 1)
        theirs_west = await demand_rows.deployment(conn, theirs, west, 3)
    return locals()


async def test_each_cluster_fetches_its_own_deployments_and_an_unchanged_state_is_304(
    plane: Plane,
) -> None:
    r = await _rows(plane)
    status, east = await plane.call("GET", "/v1/desired", r["east_token"])
    assert status == 200
    assert east["cluster"] == r["east"]
    assert [d["id"] for d in east["deployments"]] == [r["chat_east"]]
    (chat,) = east["deployments"]
    assert chat == {
        "id": r["chat_east"],
        "workload": r["chat"],
        "name": "chat",
        "engine": "vllm",
        "source": "s3://weights/chat",
        "args": ["--x"],
        "gpus": 2,
        "tp": 2,
        "replicas": 2,
        "maxInFlight": 8,
        "constraints": {
            "node": "",
            "deviceClass": "h100-80gb-sxm",
            "oneDomain": True,
            "minMemory": 0,
        },
        "authority": "managed",
        "url": "",
        "node": "",
        "paused": False,
    }
    status, west = await plane.call("GET", "/v1/desired", r["west_token"])
    assert {d["id"]: d["replicas"] for d in west["deployments"]} == {
        r["chat_west"]: 1,
        r["theirs_west"]: 3,
    }
    # The same state again: 304 on its ETag, 200 on another (or none).
    status, _, etag = await _get(plane, r["east_token"], "")
    assert status == 200
    assert etag
    status, body, again = await _get(plane, r["east_token"], etag)
    assert (status, body, again) == (304, b"", etag)
    assert (await _get(plane, r["east_token"], '"other"'))[0] == 200
    # A change on west leaves east's ETag as it was; west's changes.
    _, _, west_etag = await _get(plane, r["west_token"], "")
    async with plane.store.pool.connection() as conn:
        await conn.execute("UPDATE deployments SET replicas = 5 WHERE id = %s", (r["chat_west"],))
        await demand_rows.bump(conn, r["west"])
    assert (await _get(plane, r["east_token"], etag))[0] == 304
    status, body, _ = await _get(plane, r["west_token"], west_etag)
    assert status == 200
    assert {d["id"]: d["replicas"] for d in msgspec.json.decode(body)["deployments"]}[
        r["chat_west"]
    ] == 5
    # Paused: the declaration stays, no replica runs.
    async with plane.store.pool.connection() as conn:
        await conn.execute("UPDATE workloads SET paused = true WHERE id = %s", (r["chat"],))
    _, east = await plane.call("GET", "/v1/desired", r["east_token"])
    assert [(d["replicas"], d["paused"]) for d in east["deployments"]] == [(0, True)]
    # Only a cluster fetches a desired state (the control above: a cluster token does).
    assert (await plane.call("GET", "/v1/desired", ADMIN))[0] == 403
    assert (await plane.call("GET", "/v1/desired", r["key"]))[0] == 403
    assert (await plane.call("GET", "/v1/desired", "nope"))[0] == 401


async def _get(plane: Plane, token: str, etag: str) -> tuple[int, bytes, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if etag:
        headers["If-None-Match"] = etag
    async with (
        aiohttp.ClientSession() as session,
        session.get(plane.url + "/v1/desired", headers=headers) as response,
    ):
        return response.status, await response.read(), response.headers.get("ETag", "")


async def test_deployments_listing_and_an_observed_deployment(plane: Plane) -> None:
    r = await _rows(plane)
    status, every = await plane.call("GET", "/v1/deployments", ADMIN)
    assert status == 200
    assert {d["id"] for d in every["items"]} == {r["chat_east"], r["chat_west"], r["theirs_west"]}
    _, mine = await plane.call("GET", "/v1/deployments", r["key"])
    assert {d["id"] for d in mine["items"]} == {r["chat_east"], r["chat_west"]}
    _, east_only = await plane.call("GET", "/v1/deployments?cluster=east", ADMIN)
    assert [d["id"] for d in east_only["items"]] == [r["chat_east"]]
    _, by_wkl = await plane.call("GET", "/v1/deployments?workload=theirs", r["key"])
    assert by_wkl == {"items": []}  # another tenant's workload is as if absent
    assert (await plane.call("GET", "/v1/deployments", r["east_token"]))[0] == 403

    body = {"workload": "theirs", "cluster": "east", "url": "http://127.0.0.1:9/", "node": "e1"}
    status, _ = await plane.call("POST", "/v1/deployments", r["key"], body)
    assert status == 404  # another tenant's workload: 404, as if absent
    status, made = await plane.call("POST", "/v1/deployments", r["other_key"], body)
    assert status == 201
    assert made["authority"] == "observed"
    _, east = await plane.call("GET", "/v1/desired", r["east_token"])
    observed = {d["name"]: d for d in east["deployments"]}["theirs"]
    assert (observed["authority"], observed["url"], observed["node"]) == (
        "observed",
        "http://127.0.0.1:9/",
        "e1",
    )
    status, err = await plane.call("POST", "/v1/deployments", r["other_key"], body)
    assert status == 409, err  # one deployment per workload and cluster
    bad = {**body, "url": "ftp://x"}
    status, err = await plane.call("POST", "/v1/deployments", ADMIN, bad)
    assert status == 400
    assert "url" in err["error"]


def _replica(rid: str, dep: str, name: str, state: str = "ready", **kw: Any) -> ReplicaReport:
    return msgspec.convert(
        {"id": rid, "deploymentId": dep, "deployment": name, "state": state, **kw}, ReplicaReport
    )


async def test_a_node_replaces_only_its_own_replicas(plane: Plane) -> None:
    r = await _rows(plane)
    token = r["east_token"]
    a, b = new_node_id(), new_node_id()
    rep_a, rep_a2, rep_b = new_id("rep"), new_id("rep"), new_id("rep")
    dev = new_id("dev")

    async def sync(node: str, gen: int, replicas: list[ReplicaReport] | None, **kw: Any) -> None:
        batch = SyncBatch(
            nodeId=node,
            generation=gen,
            node=NodeSummary(name=node[-6:], version="1"),
            replicas=replicas,
            **kw,
        )
        status, answer = await plane.call("POST", "/v1/sync", token, msgspec.to_builtins(batch))
        assert status == 200, answer

    await sync(
        a,
        1,
        [
            _replica(rep_a, r["chat_east"], "chat", devices=[dev], allocation=new_id("alc")),
            _replica(rep_a2, r["theirs_west"], "theirs", state="starting"),  # west's
        ],
        facadeUrl="http://10.0.0.1:8000",
    )
    await sync(b, 1, [_replica(rep_b, r["chat_east"], "chat", state="starting")])
    rows = await _replica_rows(plane)
    assert rows[rep_a] == (r["chat_east"], a, "ready", "chat")
    assert rows[rep_a2] == (None, a, "starting", "theirs")  # another cluster's deployment
    assert rows[rep_b] == (r["chat_east"], b, "starting", "chat")
    async with plane.store.pool.connection() as conn:
        cur = await conn.execute("SELECT replica_id, device_ids FROM allocations")
        assert await cur.fetchall() == [(rep_a, [dev])]
        cur = await conn.execute("SELECT facade_url FROM nodes WHERE id = %s", (a,))
        assert await cur.fetchone() == ("http://10.0.0.1:8000",)
    # b names a's replica: a's row stays a's; b's own set is replaced (rep_b gone).
    await sync(b, 2, [_replica(rep_a, r["chat_east"], "chat", state="failed", drift="x")])
    rows = await _replica_rows(plane)
    assert rows[rep_a] == (r["chat_east"], a, "ready", "chat")
    assert rep_b not in rows
    # a's own batch without rep_a2 removes it, and without devices its allocation.
    await sync(a, 2, [_replica(rep_a, r["chat_east"], "chat", state="failed", drift="gone")])
    rows = await _replica_rows(plane)
    assert rows == {rep_a: (r["chat_east"], a, "failed", "chat")}
    _, listed = await plane.call("GET", "/v1/deployments?cluster=east", ADMIN)
    assert (
        listed["items"][0]["ready"],
        listed["items"][0]["states"],
        listed["items"][0]["drift"],
    ) == (
        0,
        {"failed": 1},
        ["gone"],
    )
    # A batch without `replicas` (an older agent) leaves them as they are.
    await sync(a, 3, None)
    assert rep_a in await _replica_rows(plane)


async def _replica_rows(plane: Plane) -> dict[str, tuple[Any, ...]]:
    async with plane.store.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, deployment_id, node_id, state, deployment_name FROM replicas"
        )
        return {row[0]: tuple(row[1:]) for row in await cur.fetchall()}
