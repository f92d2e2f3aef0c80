"""The workload routes: declare, read, scale, pause, delete and explain workloads.

    POST   /v1/workloads                  admin or tenant -> 201 {workload, placement}
    GET    /v1/workloads                  admin: all; a tenant: its own
    GET    /v1/workloads/{id|name}
    PATCH  /v1/workloads/{id|name}  {replicas, minReplicas, maxReplicas, onLoad, paused,
                                     priorityClass}
    DELETE /v1/workloads/{id|name}        its deployments go (the clusters undeploy)
    GET    /v1/workloads/{id|name}/explain

A tenant reaches its own workloads only: another tenant's is a 404, as if absent. Creating
places the workload (409 naming the quota past which it would go, or saying what fits; then
nothing is stored); a replicas change re-places the delta (`plane.placement.workload_ops`).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
from aiohttp import web

from plane.core.errors import BadInput, PlaneError
from plane.core.ids import is_id, new_id
from plane.core.roles import Role
from plane.db.connection import Conn, connection
from plane.declared.workloads import decode_create, decode_patch, digest_of
from plane.http.answers import json_answer
from plane.http.context import ApiContext
from plane.placement.sql import WorkloadNotFound, decision_view, explain, load_workload, place
from plane.placement.workload_ops import pause_workload, remove_workload, scale_workload, set_bounds

__all__ = ["mount"]

_LIST_LIMIT: Final = 1000


class _Forbidden(PlaneError):
    status = 403


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the workload routes to `app`, served over `context` (the caller, the pool)."""
    routes = _Routes(context)
    app.router.add_post("/v1/workloads", routes.create)
    app.router.add_get("/v1/workloads", routes.list)
    app.router.add_get("/v1/workloads/{ref:[^/]+}", routes.get)
    app.router.add_patch("/v1/workloads/{ref:[^/]+}", routes.patch)
    app.router.add_delete("/v1/workloads/{ref:[^/]+}", routes.delete)
    app.router.add_get("/v1/workloads/{ref:[^/]+}/explain", routes.explain)


_VIEW: Final = (
    b"SELECT w.id, w.name, w.project_id, w.artifact_id, w.kind, w.serving, w.serving_digest, "
    b"w.replicas, w.min_replicas, w.max_replicas, w.on_load, w.priority_class_id, w.constraints, "
    b"w.paused, "
    b"p.tenant_id, coalesce((SELECT json_agg(json_build_object('id', d.id, 'cluster', "
    b"d.cluster_id, 'replicas', d.replicas) ORDER BY d.cluster_id) FROM deployments d "
    b"WHERE d.workload_id = w.id), '[]') "
    b"FROM workloads w JOIN projects p ON p.id = w.project_id "
)


def _view(row: tuple[Any, ...]) -> dict[str, Any]:
    keys = (
        "id", "name", "project", "artifact", "kind", "serving", "servingDigest", "replicas",
        "minReplicas", "maxReplicas", "onLoad", "priorityClass", "constraints", "paused", "tenant",
        "deployments",
    )  # fmt: skip
    return dict(zip(keys, row, strict=True))


class _Routes:
    """The workload handlers, over the `ApiContext` they are mounted with."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context

    async def _who(self, request: web.Request) -> str | None:
        """None for the admin, the tenant id for a tenant; 403 for a cluster token."""
        role, own = await self.context.caller(request)
        if role is Role.CLUSTER:
            raise _Forbidden("workloads are the admin's or a tenant's, not a cluster's")
        return None if role is Role.ADMIN else own

    async def _resolve(self, conn: Conn, ref: str, tenant: str | None) -> str:
        """The id of workload `ref` (an id or a name) the caller may see; 404 otherwise."""
        column = b"w.id" if is_id(ref, "wkl") else b"w.name"
        row = await (
            await conn.execute(
                b"SELECT w.id, p.tenant_id FROM workloads w JOIN projects p "
                b"ON p.id = w.project_id WHERE " + column + b" = %s",
                (ref,),
            )
        ).fetchone()
        if row is None or (tenant is not None and row[1] != tenant):
            raise WorkloadNotFound(f"no workload {ref[:64]!r}")
        return str(row[0])

    async def _read(self, conn: Conn, workload_id: str) -> dict[str, Any]:
        row = await (await conn.execute(_VIEW + b"WHERE w.id = %s", (workload_id,))).fetchone()
        if row is None:
            raise WorkloadNotFound(f"no workload {workload_id!r}")
        return _view(row)

    async def create(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        asked = decode_create(await request.read())
        serving, digest = digest_of(asked.serving)
        async with connection(self.context.pool) as conn, conn.transaction():
            project = await _project(conn, asked.project, tenant)
            owner = await _owner(conn, project)
            await _artifact(conn, asked.artifact, owner)
            priority = await _priority(conn, asked.priorityClass)
            workload_id = new_id("wkl")
            taken = await (
                await conn.execute(b"SELECT 1 FROM workloads WHERE name = %s", (asked.name,))
            ).fetchone()
            if taken is not None:
                raise _NameTaken(f"name: a workload named {asked.name!r} exists already")
            await conn.execute(
                b"INSERT INTO workloads (id, project_id, artifact_id, kind, serving_digest, "
                b"serving, min_replicas, max_replicas, priority_class_id, name, replicas, "
                b"constraints, on_load) "
                b"VALUES (%s, %s, %s, 'service', %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    workload_id,
                    project,
                    asked.artifact,
                    digest,
                    msgspec.json.encode(serving).decode(),
                    asked.minReplicas,
                    asked.maxReplicas,
                    priority,
                    asked.name,
                    asked.replicas,
                    msgspec.json.encode(asked.constraints).decode(),
                    asked.onLoad,
                ),
            )
            workload = await load_workload(conn, workload_id, lock=True)
            decision = await place(conn, workload)  # PlacementRefused: 409, rolled back
            body = await self._read(conn, workload_id)
        body["placement"] = decision_view(workload, decision)
        return json_answer(body, 201)

    async def list(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        async with connection(self.context.pool) as conn:
            if tenant is None:
                cursor = await conn.execute(_VIEW + b"ORDER BY w.name LIMIT %s", (_LIST_LIMIT,))
            else:
                cursor = await conn.execute(
                    _VIEW + b"WHERE p.tenant_id = %s ORDER BY w.name LIMIT %s",
                    (tenant, _LIST_LIMIT),
                )
            rows = await cursor.fetchall()
        return json_answer({"items": [_view(r) for r in rows]})

    async def get(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        async with connection(self.context.pool) as conn:
            workload_id = await self._resolve(conn, request.match_info["ref"], tenant)
            return json_answer(await self._read(conn, workload_id))

    async def patch(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        patch = decode_patch(await request.read())
        async with connection(self.context.pool) as conn, conn.transaction():
            workload_id = await self._resolve(conn, request.match_info["ref"], tenant)
            if patch.priorityClass is not None:
                await conn.execute(
                    b"UPDATE workloads SET priority_class_id = %s WHERE id = %s",
                    (await _priority(conn, patch.priorityClass), workload_id),
                )
            bounds = (patch.minReplicas, patch.maxReplicas, patch.onLoad)
            if bounds != (None, None, None):
                await set_bounds(
                    conn, workload_id, patch.minReplicas, patch.maxReplicas, patch.replicas,
                    on_load=patch.onLoad,
                )  # fmt: skip
            if patch.replicas is not None:
                await scale_workload(conn, workload_id, patch.replicas)
            if patch.paused is not None:
                await pause_workload(conn, workload_id, patch.paused)
            return json_answer(await self._read(conn, workload_id))

    async def delete(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        async with connection(self.context.pool) as conn, conn.transaction():
            workload_id = await self._resolve(conn, request.match_info["ref"], tenant)
            touched = await remove_workload(conn, workload_id)
        return json_answer({"deleted": workload_id, "clusters": touched})

    async def explain(self, request: web.Request) -> web.Response:
        tenant = await self._who(request)
        async with connection(self.context.pool) as conn, conn.transaction():
            workload_id = await self._resolve(conn, request.match_info["ref"], tenant)
            workload = await load_workload(conn, workload_id)
            return json_answer(await explain(conn, workload))


class _NameTaken(PlaneError):
    status = 409


class _NotFound(PlaneError):
    status = 404


async def _project(conn: Conn, ref: str, tenant: str | None) -> str:
    """The project `ref` (prj_ id, or a name in the tenant) the caller may use."""
    if is_id(ref, "prj"):
        row = await (
            await conn.execute(b"SELECT id, tenant_id FROM projects WHERE id = %s", (ref,))
        ).fetchone()
        rows = [] if row is None else [row]
    else:
        rows = await (
            await conn.execute(b"SELECT id, tenant_id FROM projects WHERE name = %s", (ref,))
        ).fetchall()
    rows = [r for r in rows if tenant is None or r[1] == tenant]
    if not rows:
        raise _NotFound(f"project: no project {ref[:64]!r}")
    if len(rows) > 1:
        raise BadInput(f"project: {ref[:64]!r} names projects of several tenants; give its prj_ id")
    return str(rows[0][0])


async def _owner(conn: Conn, project: str) -> str:
    row = await (
        await conn.execute(b"SELECT tenant_id FROM projects WHERE id = %s", (project,))
    ).fetchone()
    assert row is not None
    return str(row[0])


async def _artifact(conn: Conn, ref: str, tenant: str) -> None:
    """`BadInput` / 404 unless `ref` is an artifact of the project's tenant."""
    if not is_id(ref, "art"):
        raise BadInput("artifact: an art_ id")
    row = await (
        await conn.execute(
            b"SELECT 1 FROM artifacts WHERE id = %s AND tenant_id = %s", (ref, tenant)
        )
    ).fetchone()
    if row is None:
        raise _NotFound(f"artifact: no artifact {ref!r} of the project's tenant")


async def _priority(conn: Conn, ref: str | None) -> str | None:
    """The prc_ id of priority class `ref` (a name or an id); None for none."""
    if ref is None or ref == "":
        return None
    column = b"id" if is_id(ref, "prc") else b"name"
    row = await (
        await conn.execute(b"SELECT id FROM priority_classes WHERE " + column + b" = %s", (ref,))
    ).fetchone()
    if row is None:
        raise BadInput(f"priorityClass: no priority class {ref[:64]!r}")
    return str(row[0])
