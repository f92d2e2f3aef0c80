"""The declared objects through the plane API on a real PostgreSQL: each object's life, the
validation errors that name the field, tenancy (another tenant's object is absent), tenant
keys stored hashed, and the `nvpair plane` object commands through a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

from plane.core.ids import new_id
from plane.core.tokens import hash_token
from plane.declared.api import MAX_BODY

from ..plane_client import ADMIN, Plane, enrol

DIGEST = "sha256:" + "ab" * 32


async def _made(plane: Plane, path: str, body: Any, token: str = ADMIN) -> dict[str, Any]:
    status, answer = await plane.call("POST", path, token, body)
    assert status == 201, answer
    return dict(answer)


async def _status(plane: Plane, method: str, path: str, token: str, body: Any = None) -> int:
    return (await plane.call(method, path, token, body))[0]


async def _tenant_with_key(plane: Plane, name: str) -> tuple[str, str]:
    tenant = await _made(plane, "/v1/tenants", {"name": name, "host": f"{name}.example"})
    key = await _made(plane, f"/v1/tenants/{tenant['id']}/keys", {"name": "ci"})
    return tenant["id"], key["key"]


async def test_each_object_is_created_read_listed_patched_and_deleted(plane: Plane) -> None:
    cluster, _ = await enrol(plane, "lab")
    tenant = await _made(plane, "/v1/tenants", {"name": "acme", "host": "API.Acme.Example"})
    assert tenant["host"] == "api.acme.example"
    ten = tenant["id"]
    project = await _made(plane, "/v1/projects", {"name": "chat", "tenantId": ten})
    prj = project["id"]
    objects = {
        "tenants": (tenant, {"name": "acme2"}),
        "projects": (project, {"name": "chat2"}),
        "quotas": (
            await _made(
                plane,
                "/v1/quotas",
                {"projectId": prj, "deviceClass": "h100-80gb-sxm", "maxDevices": 8},
            ),
            {"maxDevices": 4, "guaranteed": 2},
        ),
        "priority-classes": (
            await _made(plane, "/v1/priority-classes", {"name": "high", "value": 1000}),
            {"preemptible": True},
        ),
        "policies": (
            await _made(
                plane,
                "/v1/policies",
                {"attachedTo": ten, "spec": {"regions": ["eu"], "denyClusters": [cluster]}},
            ),
            {"spec": {"residency": "eu"}},
        ),
        "pools": (
            await _made(
                plane,
                "/v1/pools",
                {"name": "big", "deviceClass": "l4", "maxNodes": 3, "spec": {"nodeShape": "8x"}},
            ),
            {"spec": {"labels": {"zone": "a"}}},
        ),
        "artifacts": (
            await _made(
                plane,
                "/v1/artifacts",
                {"digest": DIGEST, "kind": "base", "locations": ["s3://w/a"], "tenantId": ten},
            ),
            None,
        ),
    }
    for path, (made, change) in objects.items():
        object_id = made["id"]
        assert (await plane.call("GET", f"/v1/{path}/{object_id}", ADMIN)) == (200, made)
        status, listed = await plane.call("GET", f"/v1/{path}", ADMIN)
        assert status == 200
        assert [o["id"] for o in listed["items"]] == [object_id]
        status, patched = await plane.call("PATCH", f"/v1/{path}/{object_id}", ADMIN, change or {})
        if change is None:  # artifacts are immutable
            assert status == 405
            assert "immutable" in patched["error"]
            continue
        assert status == 200, patched
        assert (await plane.call("GET", f"/v1/{path}/{object_id}", ADMIN)) == (200, patched)
        objects[path] = (patched, change)
    # A spec patch merges: the policy keeps its regions and deny list, gains a residency.
    spec = objects["policies"][0]["spec"]
    assert (spec["regions"], spec["residency"], spec["denyClusters"]) == (["eu"], "eu", [cluster])
    assert objects["pools"][0]["spec"] == {"nodeShape": "8x", "labels": {"zone": "a"}, "taints": []}
    assert objects["quotas"][0]["guaranteed"] == 2
    status, attrs = await plane.call(
        "PATCH", f"/v1/clusters/{cluster}", ADMIN, {"region": "eu", "costPerDeviceHour": 2.5}
    )
    assert (status, attrs["region"], attrs["costPerDeviceHour"]) == (200, "eu", 2.5)
    (listed,) = [
        c for c in (await plane.call("GET", "/v1/clusters", ADMIN))[1] if c["id"] == cluster
    ]
    assert (listed["region"], listed["residency"], listed["costPerDeviceHour"]) == ("eu", "", 2.5)
    # A page of a list ends with the id to ask for the next one after.
    await _made(plane, "/v1/priority-classes", {"name": "low", "value": 1})
    status, page = await plane.call("GET", "/v1/priority-classes?limit=1", ADMIN)
    assert (status, len(page["items"])) == (200, 1)
    status, rest = await plane.call("GET", f"/v1/priority-classes?after={page['next']}", ADMIN)
    assert [o["name"] for o in rest["items"]] == ["low"]
    # What a workload still names is not deleted under it: a 409 naming what refers to it.
    artifact = objects["artifacts"][0]["id"]
    async with plane.store.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO workloads (id, project_id, artifact_id, serving_digest, serving, name) "
            "VALUES (%s, %s, %s, %s, '{}', 'w')",
            (new_id("wkl"), prj, artifact, "svg_" + "0" * 64),
        )
    status, answer = await plane.call("DELETE", f"/v1/projects/{prj}", ADMIN)
    assert (status, "still referenced by workloads" in answer["error"]) == (409, True), answer
    async with plane.store.pool.connection() as conn:
        await conn.execute("DELETE FROM workloads")
    # Delete leaves-first; the tenant goes last (its projects cascade with it).
    for path in ("artifacts", "policies", "quotas", "pools", "priority-classes", "projects"):
        object_id = objects[path][0]["id"]
        assert await _status(plane, "DELETE", f"/v1/{path}/{object_id}", ADMIN) == 200
        assert await _status(plane, "GET", f"/v1/{path}/{object_id}", ADMIN) == 404
        assert await _status(plane, "DELETE", f"/v1/{path}/{object_id}", ADMIN) == 404
    assert await _status(plane, "DELETE", f"/v1/tenants/{ten}", ADMIN) == 200
    assert (await plane.call("GET", "/v1/tenants", ADMIN)) == (200, {"items": []})


# (path, body, status, words in the error): each refused, nothing written.
BAD_BODIES: list[tuple[str, Any, int, str]] = [
    ("/v1/tenants", {"name": "b", "host": "no spaces.example"}, 400, "`$.host`"),
    ("/v1/tenants", {"name": "b", "colour": "red"}, 400, "unknown field `colour`"),
    ("/v1/tenants", {"name": 7}, 400, "got `int` - at `$.name`"),
    ("/v1/tenants", {"name": "b\x00"}, 400, "`$.name`"),
    ("/v1/tenants", {"name": "a"}, 409, "a tenant of that name exists"),
    ("/v1/tenants", {"name": "b", "host": "A.EXAMPLE"}, 409, "`$.host`"),
    ("/v1/tenants", b"{not json", 400, "not a JSON object"),
    ("/v1/tenants", b'{"name": "b"}\x00', 400, "not a JSON object"),
    ("/v1/tenants", b" " * (MAX_BODY + 1), 413, f"at most {MAX_BODY} bytes"),
    ("/v1/projects", {"name": "p"}, 400, "tenantId is required"),
    ("/v1/projects", {"name": "p", "tenantId": "ten_" + "0" * 26}, 404, "`$.tenantId`"),
    (
        "/v1/quotas",
        {"projectId": "prj_" + "0" * 26, "deviceClass": "l4", "maxDevices": 1},
        404,
        "`$.projectId`",
    ),
    (
        "/v1/artifacts",
        {"digest": "md5:1", "kind": "base", "locations": ["/w"]},
        400,
        "`$.digest`",
    ),
    (
        "/v1/artifacts",
        {"digest": DIGEST, "kind": "gguf", "locations": ["/w"]},
        400,
        "`$.kind`",
    ),
    (
        "/v1/artifacts",
        {"digest": DIGEST, "kind": "lora", "locations": []},
        400,
        "`$.locations`",
    ),
    ("/v1/policies", {"attachedTo": "wkl_" + "0" * 26}, 404, "`$.attachedTo`"),
    (
        "/v1/policies",
        {"attachedTo": "ten_" + "0" * 26, "spec": {"regions": ["eu"] * 65}},
        400,
        "`$.spec.regions`",
    ),
    (
        "/v1/pools",
        {"name": "p", "deviceClass": "l4", "minNodes": 3, "maxNodes": 1},
        400,
        "`$.minNodes`",
    ),
    ("/v1/priority-classes", {"name": "x", "value": 2**40}, 400, "`$.value`"),
]


async def test_bad_bodies_are_refused_naming_the_field_and_write_nothing(plane: Plane) -> None:
    tenant = await _made(plane, "/v1/tenants", {"name": "a", "host": "a.example"})  # clashes
    artifact = {"digest": DIGEST, "kind": "base", "locations": ["/w"], "tenantId": tenant["id"]}
    await _made(plane, "/v1/artifacts", artifact)
    clashes = [("/v1/artifacts", artifact, 409, "artifact with that digest")]
    for path, body, status, words in [*BAD_BODIES, *clashes]:
        got, answer = await plane.call("POST", path, ADMIN, body)
        assert (got, words in answer["error"]) == (status, True), (body, answer)
    for listed in ("tenants", "projects", "quotas", "artifacts", "policies", "pools"):
        _, page = await plane.call("GET", f"/v1/{listed}", ADMIN)
        assert len(page["items"]) == (1 if listed in ("tenants", "artifacts") else 0), listed


async def test_a_tenant_sees_and_changes_only_its_own_objects(plane: Plane) -> None:
    cluster, cluster_token = await enrol(plane, "lab")
    a, key_a = await _tenant_with_key(plane, "a")
    b, key_b = await _tenant_with_key(plane, "b")
    # A tenant key's objects go in its own tenant, without naming it.
    project = await _made(plane, "/v1/projects", {"name": "chat"}, key_a)
    assert project["tenantId"] == a
    policy = await _made(plane, "/v1/policies", {"attachedTo": a}, key_a)
    artifact = await _made(
        plane, "/v1/artifacts", {"digest": DIGEST, "kind": "base", "locations": ["/w"]}, key_a
    )
    quota = {"projectId": project["id"], "deviceClass": "l4", "maxDevices": 2}
    assert await _status(plane, "POST", "/v1/quotas", key_a, quota) == 403  # admin only
    made_quota = await _made(plane, "/v1/quotas", quota)
    owned = {
        "tenants": a,
        "projects": project["id"],
        "policies": policy["id"],
        "artifacts": artifact["id"],
        "quotas": made_quota["id"],
    }
    for path, object_id in owned.items():
        assert await _status(plane, "GET", f"/v1/{path}/{object_id}", key_a) == 200
        assert await _status(plane, "GET", f"/v1/{path}/{object_id}", key_b) == 404
        _, page_a = await plane.call("GET", f"/v1/{path}", key_a)
        _, page_b = await plane.call("GET", f"/v1/{path}", key_b)
        assert [o["id"] for o in page_a["items"]] == [object_id], path
        assert object_id not in [o["id"] for o in page_b["items"]], path
    for path in ("projects", "policies"):  # b cannot change or delete a's; a can
        object_id = owned[path]
        assert await _status(plane, "PATCH", f"/v1/{path}/{object_id}", key_b, {"name": "x"}) == 404
        assert await _status(plane, "DELETE", f"/v1/{path}/{object_id}", key_b) == 404
        assert await _status(plane, "PATCH", f"/v1/{path}/{object_id}", key_a, {"name": "y"}) == 200
    assert await _status(plane, "DELETE", f"/v1/artifacts/{artifact['id']}", key_b) == 404
    assert await _status(plane, "DELETE", f"/v1/artifacts/{artifact['id']}", key_a) == 200
    # Quotas are read-only to a tenant; a tenant cannot place objects in another tenant.
    change = {"maxDevices": 99}
    assert await _status(plane, "PATCH", f"/v1/quotas/{made_quota['id']}", key_a, change) == 403
    assert await _status(plane, "PATCH", f"/v1/tenants/{a}", key_a, {"name": "z"}) == 403
    named_b = {"name": "p", "tenantId": b}
    assert await _status(plane, "POST", "/v1/projects", key_a, named_b) == 404
    assert await _status(plane, "POST", "/v1/policies", key_a, {"attachedTo": b}) == 404
    assert await _status(plane, "POST", "/v1/policies", key_a, {"attachedTo": cluster}) == 403
    assert await _status(plane, "POST", "/v1/policies", ADMIN, {"attachedTo": cluster}) == 201
    # The admin's own policy on a's tenant is beyond a's reach; one it gives a is a's.
    imposed = await _made(plane, "/v1/policies", {"attachedTo": a, "spec": {"residency": "eu"}})
    given = await _made(plane, "/v1/policies", {"attachedTo": a, "tenantId": a})
    assert await _status(plane, "DELETE", f"/v1/policies/{imposed['id']}", key_a) == 404
    assert await _status(plane, "DELETE", f"/v1/policies/{given['id']}", key_a) == 200
    not_bs = {"attachedTo": a, "tenantId": b}
    assert await _status(plane, "POST", "/v1/policies", ADMIN, not_bs) == 400
    assert await _status(plane, "GET", f"/v1/tenants/{b}/keys", key_a) == 404
    assert await _status(plane, "GET", f"/v1/tenants/{a}/keys", key_a) == 200
    # Installation-wide: priority classes anyone reads, only the admin writes; pools and
    # cluster attributes are the admin's alone.
    prc = await _made(plane, "/v1/priority-classes", {"name": "low", "value": 1})
    assert await _status(plane, "GET", f"/v1/priority-classes/{prc['id']}", key_b) == 200
    assert await _status(plane, "GET", "/v1/priority-classes", cluster_token) == 200
    assert (
        await _status(plane, "POST", "/v1/priority-classes", key_b, {"name": "x", "value": 1})
        == 403
    )
    assert await _status(plane, "GET", "/v1/pools", key_b) == 403
    assert await _status(plane, "GET", "/v1/pools", ADMIN) == 200
    assert await _status(plane, "PATCH", f"/v1/clusters/{cluster}", key_b, {"region": "x"}) == 403
    assert await _status(plane, "GET", "/v1/projects", cluster_token) == 403


async def test_keys_are_stored_hashed_and_a_revoked_key_is_refused(plane: Plane) -> None:
    tenant, key = await _tenant_with_key(plane, "a")
    second = await _made(plane, f"/v1/tenants/{tenant}/keys", {})
    async with plane.store.pool.connection() as conn:
        rows = await (await conn.execute("SELECT hash, name FROM tenant_keys")).fetchall()
    secret = key.removeprefix("nvt1.")
    assert sorted(r[0] for r in rows) == sorted([hash_token(key), hash_token(second["key"])])
    assert not any(secret in str(cell) for row in rows for cell in row)
    status, listed = await plane.call("GET", f"/v1/tenants/{tenant}/keys", ADMIN)
    assert status == 200
    assert "key" not in listed["items"][0]
    assert secret not in json.dumps(listed)
    assert await _status(plane, "GET", f"/v1/tenants/{tenant}", key) == 200
    mine = next(k["id"] for k in listed["items"] if k["name"] == "ci")
    assert await _status(plane, "DELETE", f"/v1/tenants/{tenant}/keys/{mine}", key) == 200
    assert await _status(plane, "GET", f"/v1/tenants/{tenant}", key) == 401
    assert await _status(plane, "GET", f"/v1/tenants/{tenant}", second["key"]) == 200


async def test_the_cli_creates_gets_patches_and_deletes(plane: Plane) -> None:
    env = {**os.environ, "NVPAIR_PLANE_URL": plane.url, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}

    async def nvpair(*words: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "agent", "plane", *words],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = await nvpair("create", "tenant", "name=acme", "host=Acme.Example")
    assert made.returncode == 0, made.stderr
    tenant = next(line.split(": ")[1] for line in made.stdout.splitlines() if line[:4] == "id: ")
    created = await nvpair("create", "policy", f"attachedTo={tenant}", 'spec.regions=["eu"]')
    assert created.returncode == 0, created.stderr
    got = await nvpair("get", "policies", "--json")
    assert json.loads(got.stdout)["items"][0]["spec"]["regions"] == ["eu"]
    key = await nvpair("tenant-key", "acme")
    assert key.returncode == 0, key.stderr
    assert key.stdout.startswith("nvt1.")
    env.pop("NVPAIR_PLANE_ADMIN_TOKEN")
    env["NVPAIR_PLANE_KEY"] = key.stdout.strip()
    refused = await nvpair("patch", "tenant", tenant, "host=x.example")
    assert refused.returncode == 1
    assert "the plane refused (403): only the admin token may change tenants" in refused.stderr


async def test_no_wrong_value_in_any_field_is_a_server_error(plane: Plane) -> None:
    # Every field of every kind's valid body replaced by values of the wrong type, out of
    # bounds or with a NUL: each answer is the caller's fault (4xx) or a success, never a 500.
    cluster, _ = await enrol(plane, "lab")
    tenant = await _made(plane, "/v1/tenants", {"name": "a"})
    project = await _made(plane, "/v1/projects", {"name": "p", "tenantId": tenant["id"]})
    pool = {"name": "p", "deviceClass": "l4", "maxNodes": 2, "clusterId": cluster}
    valid = {
        "/v1/tenants": {"name": "b", "host": "b.example"},
        "/v1/projects": {"name": "q", "tenantId": tenant["id"]},
        "/v1/quotas": {"projectId": project["id"], "deviceClass": "l4", "maxDevices": 2},
        "/v1/priority-classes": {"name": "c", "value": 1, "description": "d"},
        "/v1/policies": {"attachedTo": tenant["id"], "spec": {"regions": ["eu"]}},
        "/v1/pools": {**pool, "spec": {"labels": {"a": "b"}}},
        "/v1/artifacts": {
            "digest": DIGEST,
            "kind": "base",
            "locations": ["/w"],
            "tenantId": tenant["id"],
        },
    }
    wrong: list[Any] = [None, -1, 2**64, "x" * 5000, "\x00", [], {"a": 1}]
    statuses: set[int] = set()
    for path, body in valid.items():
        made = await _made(plane, path, body)
        for field in body:
            for value in wrong:
                status, answer = await plane.call("POST", path, ADMIN, {**body, field: value})
                assert status < 500, (path, field, value, answer)
                statuses.add(status)
                if path != "/v1/artifacts":
                    status, answer = await plane.call(
                        "PATCH", f"{path}/{made['id']}", ADMIN, {field: value}
                    )
                    assert status < 500, (path, field, value, answer)
    assert {400, 409} <= statuses
