"""The workload API on a real PostgreSQL, in process: create places across clusters, a scale
change moves only the delta, explain says why, delete removes the deployments; quotas are
named when refused; tenants reach only their own workloads; bad bodies name the field.

Clusters are enrolled through the API; their nodes, devices, domains, tenants, projects,
artifacts, quotas and policies go in with plain SQL on the 0006 schema."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from typing import Any

import psycopg
import pytest

from agent.cli.main import main as nvpair
from plane.core.ids import new_id
from plane.core.tenant_keys import mint_tenant_key
from plane.core.tokens import hash_token

from ..plane_client import ADMIN, Plane, enrol

H100 = "h100-80gb-sxm"


class World:
    """Three clusters and two tenants, as the tests below need them."""

    def __init__(self) -> None:
        self.clusters: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.projects: dict[str, str] = {}
        self.artifacts: dict[str, str] = {}
        self.quota = new_id("qta")
        self.policy = new_id("plc")


async def _world(plane: Plane, dsn: str) -> World:
    w = World()
    for name in ("a", "b", "c"):
        w.clusters[name], w.tokens[name] = await enrol(plane, name)
    # a: 8 H100 in two NVLink domains of 4; b: one domain of 4; c (us-east): a domain of 8.
    layout = {"a": [4, 4], "b": [4], "c": [8]}
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for name, domains in layout.items():
            cid = w.clusters[name]
            region = "us-east" if name == "c" else "eu-west"
            await conn.execute("UPDATE clusters SET region = %s WHERE id = %s", (region, cid))
            node = new_id("nod")
            await conn.execute(
                "INSERT INTO nodes (id, cluster_id, name, reachable, cordoned, version, "
                "generation) VALUES (%s, %s, %s, true, false, 'test', 1)",
                (node, cid, f"{name}-1"),
            )
            for size in domains:
                domain, devices = new_id("tpd"), [new_id("dev") for _ in range(size)]
                for dev in devices:
                    await conn.execute(
                        "INSERT INTO devices (id, node_id, cluster_id, uuid, device_class, "
                        "health, memory_total, memory_used, domain_id, generation) VALUES "
                        "(%s, %s, %s, %s, %s, 'ok', 85899345920, 0, %s, 1)",
                        (dev, node, cid, "GPU-" + dev, H100, domain),
                    )
                await conn.execute(
                    "INSERT INTO topology_domains (id, node_id, cluster_id, kind, device_ids, "
                    "generation) VALUES (%s, %s, %s, 'nvlink', %s, 1)",
                    (domain, node, cid, devices),
                )
        for tenant in ("t1", "t2"):
            tid, pid, aid = new_id("ten"), new_id("prj"), new_id("art")
            await conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tid, tenant))
            w.keys[tenant] = mint_tenant_key()
            await conn.execute(
                "INSERT INTO tenant_keys (hash, tenant_id) VALUES (%s, %s)",
                (hash_token(w.keys[tenant]), tid),
            )
            await conn.execute(
                "INSERT INTO projects (id, tenant_id, name) VALUES (%s, %s, 'prod')", (pid, tid)
            )
            await conn.execute(
                "INSERT INTO artifacts (id, digest, kind, tenant_id) VALUES "
                "(%s, %s, 'weights', %s)",
                (aid, "sha256:" + "0" * 64, tid),
            )
            w.projects[tenant], w.artifacts[tenant] = pid, aid
            if tenant == "t1":  # t1 runs in eu-west only; its project has 12 H100 fleet-wide
                await conn.execute(
                    "INSERT INTO policies (id, attached_to, spec, tenant_id) VALUES "
                    "(%s, %s, %s, %s)",
                    (w.policy, tid, json.dumps({"regions": ["eu-west"]}), tid),
                )
                await conn.execute(
                    "INSERT INTO quotas (id, project_id, device_class, max_devices) VALUES "
                    "(%s, %s, %s, 12)",
                    (w.quota, pid, H100),
                )
        await conn.execute(
            "INSERT INTO priority_classes (id, name, value) VALUES (%s, 'high', 100)",
            (new_id("prc"),),
        )
    return w


def body(w: World, tenant: str = "t1", **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": f"llama-{tenant}",
        "project": w.projects[tenant],
        "artifact": w.artifacts[tenant],
        "serving": {"engine": "vllm", "gpus": 4, "tp": 4, "quantization": "fp8"},
        "replicas": 2,
        "maxReplicas": 8,
        "priorityClass": "high",
        "constraints": {"deviceClass": H100, "oneDomain": True},
    }
    return base | over


async def generations(dsn: str) -> dict[str, int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        rows = await (await conn.execute("SELECT id, desired_generation FROM clusters")).fetchall()
    return dict(rows)


def shares(workload: dict[str, Any]) -> dict[str, int]:
    return {d["cluster"]: d["replicas"] for d in workload["deployments"]}


async def test_create_scale_explain_delete(plane: Plane, pg_dsn: str) -> None:
    w = await _world(plane, pg_dsn)
    key = w.keys["t1"]
    a, b, c = w.clusters["a"], w.clusters["b"], w.clusters["c"]
    before = await generations(pg_dsn)
    status, created = await plane.call("POST", "/v1/workloads", key, body(w))
    assert status == 201, created
    # Webster over a's 2 and b's 1 one-domain TP-4 replicas; c is outside t1's policy.
    assert shares(created) == {a: 1, b: 1}
    assert created["servingDigest"].startswith("svg_")
    assert created["serving"]["gpus"] == 4
    after = await generations(pg_dsn)
    assert [after[x] - before[x] for x in (a, b, c)] == [1, 1, 0]

    # Scale up by one: a has a free domain of 4 left, b none (its one replica is reserved).
    status, scaled = await plane.call(
        "PATCH", f"/v1/workloads/{created['id']}", key, {"replicas": 3}
    )
    assert status == 200, scaled
    assert shares(scaled) == {a: 2, b: 1}
    moved = await generations(pg_dsn)
    assert [moved[x] - after[x] for x in (a, b, c)] == [1, 0, 0]  # only the delta's cluster
    b_dep = next(d["id"] for d in scaled["deployments"] if d["cluster"] == b)
    assert b_dep == next(d["id"] for d in created["deployments"] if d["cluster"] == b)

    # One more would take the project past its quota: 409, naming it; nothing changes.
    status, refused = await plane.call(
        "PATCH", f"/v1/workloads/{created['id']}", key, {"replicas": 4}
    )
    assert status == 409
    for part in (w.quota, w.projects["t1"], H100, "limit 12", "in use 12", "asked 4"):
        assert part in refused["error"]
    assert shares((await plane.call("GET", "/v1/workloads/llama-t1", key))[1]) == {a: 2, b: 1}

    # Explain, by name, from the API and from `nvpair plane explain`.
    status, why = await plane.call("GET", "/v1/workloads/llama-t1/explain", key)
    assert status == 200
    by = {e["cluster"]: e for e in why["clusters"]}
    assert why["shares"] == {a: 2, b: 1}
    assert by[c]["refusedBy"] == f"policy {w.policy}"
    assert "us-east" in by[c]["reason"]
    assert by[a]["chosen"]
    assert by[b]["chosen"]
    out = await _cli(["plane", "explain", "llama-t1", "--plane", plane.url], key)
    assert "llama-t1" in out
    assert f"c ({c}): refused by policy {w.policy}" in out
    assert f"a ({a}): chosen, share 2" in out

    # Scale down to 1: taken from the largest share; b's row stays as it was.
    status, down = await plane.call("PATCH", "/v1/workloads/llama-t1", key, {"replicas": 1})
    assert status == 200, down
    assert shares(down) == {b: 1}  # a 1-1 tie after the first: the lower id (a) loses
    # Pause: the deployments stay, their clusters are told.
    gen = await generations(pg_dsn)
    status, paused = await plane.call("PATCH", "/v1/workloads/llama-t1", key, {"paused": True})
    assert (status, paused["paused"], shares(paused)) == (200, True, {b: 1})
    assert (await generations(pg_dsn))[b] == gen[b] + 1

    gen = await generations(pg_dsn)
    status, deleted = await plane.call("DELETE", "/v1/workloads/llama-t1", key)
    assert (status, deleted["clusters"]) == (200, [b])
    assert (await generations(pg_dsn))[b] == gen[b] + 1
    assert (await plane.call("GET", "/v1/workloads/llama-t1", key))[0] == 404
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        left = await (await conn.execute("SELECT count(*) FROM deployments")).fetchone()
    assert left == (0,)

    # Devices a replica holds (its allocation) are not free: with one device of each of a's
    # domains held, a one-domain TP-4 replica goes to b, though Webster would favour a.
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        held = await (
            await conn.execute(
                "SELECT DISTINCT ON (domain_id) id FROM devices WHERE cluster_id = %s", (a,)
            )
        ).fetchall()
        replica = new_id("rep")
        await conn.execute(
            "INSERT INTO replicas (id, cluster_id, node_id, ready, generation) "
            "VALUES (%s, %s, 'n', true, 1)",
            (replica, a),
        )
        await conn.execute(
            "INSERT INTO allocations (id, replica_id, device_ids) VALUES (%s, %s, %s)",
            (new_id("alc"), replica, [h[0] for h in held]),
        )
    status, small = await plane.call("POST", "/v1/workloads", key, body(w, replicas=1))
    assert status == 201, small
    assert shares(small) == {b: 1}


async def test_a_workload_on_load_is_placed_at_its_max_and_its_clusters_share_its_min(
    plane: Plane, pg_dsn: str
) -> None:
    w = await _world(plane, pg_dsn)
    key = w.keys["t1"]
    a, b = w.clusters["a"], w.clusters["b"]

    async def told(cluster: str) -> dict[str, Any]:
        status, state = await plane.call("GET", "/v1/desired", w.tokens[cluster])
        assert status == 200, state
        (deployment,) = state["deployments"]
        return dict(deployment)

    # The quota (12 H100) counts the max: 4 replicas of 4 GPUs are refused though the min,
    # 1, would fit -- a cluster must be able to reach its max share.
    ask = body(w, onLoad=True, minReplicas=1, maxReplicas=4)
    status, refused = await plane.call("POST", "/v1/workloads", key, ask)
    assert status == 409, refused
    assert "asked 16" in refused["error"]
    status, made = await plane.call("POST", "/v1/workloads", key, ask | {"maxReplicas": 3})
    assert status == 201, made
    assert (made["onLoad"], made["replicas"], shares(made)) == (True, 3, {a: 2, b: 1})
    # Each cluster: its share of the max as replicas, its part of the min (Webster over the
    # shares: a's 2 outweigh b's 1).
    assert [(d["replicas"], d["minReplicas"]) for d in (await told("a"), await told("b"))] == [
        (2, 1), (1, 0),
    ]  # fmt: skip
    # Its count is its clusters': a replicas change is refused, naming what to change.
    status, no = await plane.call("PATCH", "/v1/workloads/llama-t1", key, {"replicas": 2})
    assert status == 400
    assert no["error"].startswith("replicas: ")
    assert "maxReplicas" in no["error"]
    # A new min is told to the clusters, their shares of the max unchanged.
    gen = await generations(pg_dsn)
    status, more = await plane.call("PATCH", "/v1/workloads/llama-t1", key, {"minReplicas": 3})
    assert status == 200, more
    assert (await generations(pg_dsn))[b] > gen[b]
    assert [(d["replicas"], d["minReplicas"]) for d in (await told("a"), await told("b"))] == [
        (2, 2), (1, 1),
    ]  # fmt: skip
    # A lower max re-places only the delta; off load, the count stays what was placed.
    status, fewer = await plane.call(
        "PATCH", "/v1/workloads/llama-t1", key, {"minReplicas": 0, "maxReplicas": 2}
    )
    assert status == 200, fewer
    assert (fewer["replicas"], shares(fewer)) == (2, {a: 1, b: 1})
    status, fixed = await plane.call("PATCH", "/v1/workloads/llama-t1", key, {"onLoad": False})
    assert (status, fixed["onLoad"], fixed["replicas"]) == (200, False, 2)
    assert "minReplicas" not in await told("a")  # a fixed count again: no min to share


async def _cli(argv: list[str], key: str) -> str:
    def run() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert nvpair(argv) == 0
        return out.getvalue()

    with pytest.MonkeyPatch.context() as env:
        env.setenv("NVPAIR_PLANE_KEY", key)
        return await asyncio.to_thread(run)


async def test_tenants_and_bad_bodies(plane: Plane, pg_dsn: str) -> None:
    w = await _world(plane, pg_dsn)
    t1, t2 = w.keys["t1"], w.keys["t2"]
    status, mine = await plane.call("POST", "/v1/workloads", t1, body(w, replicas=1))
    assert status == 201, mine
    # Another tenant's workload is absent to t2, whichever way it asks.
    for method, path, payload in (
        ("GET", f"/v1/workloads/{mine['id']}", None),
        ("GET", "/v1/workloads/llama-t1/explain", None),
        ("PATCH", "/v1/workloads/llama-t1", {"replicas": 2}),
        ("DELETE", f"/v1/workloads/{mine['id']}", None),
    ):
        assert (await plane.call(method, path, t2, payload))[0] == 404, (method, path)
    assert (await plane.call("GET", "/v1/workloads", t2))[1] == {"items": []}
    # Nor may t2 use t1's project or artifact.
    status, err = await plane.call(
        "POST", "/v1/workloads", t2, body(w, "t2", project=w.projects["t1"])
    )
    assert (status, err["error"].split(":")[0]) == (404, "project")
    status, err = await plane.call(
        "POST", "/v1/workloads", t2, body(w, "t2", artifact=w.artifacts["t1"])
    )
    assert (status, err["error"].split(":")[0]) == (404, "artifact")
    assert (await plane.call("GET", "/v1/workloads", w.tokens["a"]))[0] == 403
    # The controls: t2's own workload (c is open to t2: no policy), the admin sees both.
    status, theirs = await plane.call("POST", "/v1/workloads", t2, body(w, "t2", project="prod"))
    assert status == 201, theirs
    assert shares(theirs) == {w.clusters["c"]: 1, w.clusters["a"]: 1}
    status, listed = await plane.call("GET", "/v1/workloads", ADMIN)
    assert [x["name"] for x in listed["items"]] == ["llama-t1", "llama-t2"]
    assert (await plane.call("GET", f"/v1/workloads/{mine['id']}", t1))[0] == 200

    # Bad bodies: 400 naming the field; nothing stored.
    cases: list[tuple[dict[str, Any], str]] = [
        ({"kind": "task"}, "kind: 'task' is reserved"),
        ({"kind": "gang"}, "kind: 'gang' is reserved"),
        ({"kind": "batch"}, "kind:"),
        ({"serving": {"engine": "vllm", "gpus": -1}}, "serving.gpus:"),
        ({"serving": {"engine": "vllm", "gpus": 2, "tp": 4}}, "serving.tp:"),
        ({"serving": {"engine": "vllm", "colour": 1}}, "serving.colour"),
        ({"constraints": {"oneDomain": True}}, "constraints.deviceClass:"),
        ({"replicas": 9}, "replicas:"),
        ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas:"),
        ({"name": "-bad"}, "name:"),
        ({"priorityClass": "nope"}, "priorityClass:"),
        ({"artifact": "weights"}, "artifact:"),
    ]
    for over, starts in cases:
        status, err = await plane.call(
            "POST", "/v1/workloads", t2, body(w, "t2", **({"name": "x"} | over))
        )
        assert status == 400, (over, err)
        assert err["error"].startswith(starts), (over, err)
    status, err = await plane.call("POST", "/v1/workloads", t2, body(w, "t2", name="llama-t1"))
    assert (status, err["error"].split(":")[0]) == (409, "name")
    status, err = await plane.call("PATCH", "/v1/workloads/llama-t2", t2, {"replicas": 20})
    assert (status, err["error"].split(":")[0]) == (400, "replicas")
    status, err = await plane.call("PATCH", "/v1/workloads/llama-t2", t2, {"name": "y"})
    assert (status, err["error"].split(":")[0]) == (400, "name")
    # Not enough room anywhere: 409 saying what fits, and the workload is not stored.
    status, err = await plane.call(
        "POST", "/v1/workloads", t2, body(w, "t2", name="huge", replicas=8)
    )
    assert status == 409
    assert "fit" in err["error"]
    assert (await plane.call("GET", "/v1/workloads/huge", t2))[0] == 404
