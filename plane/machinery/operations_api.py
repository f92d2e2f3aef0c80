"""Plane operations over HTTP: drain, cordon and uncordon a node; scale, pause and resume a
workload (docs/plane-operations.md).

    POST /v1/operations {kind, target, reason, force, timeoutS, replicas}
                                        admin; a tenant: scale / pause / resume of its own
                                        workloads -> 201 the operation
    GET  /v1/operations?cluster=&phase=&limit=   admin, a cluster (its own), a tenant (its own)
    GET  /v1/operations/{id}            the same

A node operation is its target node's cluster's to carry out (listed in that cluster's
desired state until final); a workload one is carried out at once, in the plane.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from plane.core.ids import is_id
from plane.core.roles import Role
from plane.db.connection import connection
from plane.machinery import sql as machinery_sql

__all__ = ["OperationRequest", "mount"]

MAX_REQUEST: Final = 16_384


class OperationRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/operations`."""

    kind: Literal["drain", "cordon", "uncordon", "scale", "pause", "resume"]
    target: Annotated[str, Meta(max_length=64)]
    reason: Annotated[str, Meta(max_length=500, pattern=r"^[^\x00]*$")] = ""
    force: bool = False
    timeoutS: Annotated[float, Meta(gt=0, le=86_400)] = 300.0
    replicas: Annotated[int, Meta(ge=0, le=1024)] | None = None


_decoder: Final = msgspec.json.Decoder(OperationRequest)


def json_response(value: Any, status: int = 200) -> web.Response:
    """`value` as a JSON response."""
    return web.Response(
        body=msgspec.json.encode(value), status=status, content_type="application/json"
    )


def refuse(status: int, message: str) -> web.HTTPException:
    """An HTTP error whose body is `{"error": message}` (the server's one error shape)."""
    kinds: dict[int, type[web.HTTPException]] = {
        400: web.HTTPBadRequest,
        403: web.HTTPForbidden,
        404: web.HTTPNotFound,
    }
    body = msgspec.json.encode({"error": message}).decode()
    if status == 413:
        return web.HTTPRequestEntityTooLarge(
            max_size=MAX_REQUEST, actual_size=MAX_REQUEST + 1, text=body,
            content_type="application/json",
        )  # fmt: skip
    return kinds[status](text=body, content_type="application/json")


def limit_param(request: web.Request, default: int = 100, most: int = 1000) -> int:
    """The `limit` query parameter, 1 to `most`; 400 when it is not a number."""
    text = request.query.get("limit", str(default)).strip()
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise refuse(400, f"limit is a number from 1 to {most}")
    return max(1, min(int(text), most))


def mount(app: web.Application, server: Any) -> None:
    """Add the operations routes."""
    pool = server.store.pool

    async def create(request: web.Request) -> web.Response:
        role, own = await server.caller(request)
        if role is Role.CLUSTER:
            raise refuse(403, "a cluster token cannot start plane operations")
        body = await request.read()
        if len(body) > MAX_REQUEST:
            raise refuse(413, f"the body is at most {MAX_REQUEST} bytes")
        try:
            asked = _decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise refuse(400, f"invalid operation: {exc}") from exc
        except (msgspec.DecodeError, RecursionError) as exc:
            raise refuse(400, "the body is a JSON operation: {kind, target, ...}") from exc
        node_kind = asked.kind in machinery_sql.NODE_KINDS
        prefix = "nod" if node_kind else "wkl"
        if not is_id(asked.target, prefix):
            raise refuse(400, f"target of a {asked.kind} is a {prefix}_ id (at `$.target`)")
        if asked.kind == "scale" and asked.replicas is None:
            raise refuse(400, "a scale needs replicas (at `$.replicas`)")
        if asked.kind != "scale" and asked.replicas is not None:
            raise refuse(400, f"a {asked.kind} takes no replicas (at `$.replicas`)")
        if node_kind and role is not Role.ADMIN:
            raise refuse(403, f"a {asked.kind} needs the admin token")
        payload: dict[str, Any] = {"force": asked.force, "timeoutS": asked.timeoutS}
        if asked.replicas is not None:
            payload["replicas"] = asked.replicas
        async with connection(pool) as conn:
            if node_kind:
                cursor = await conn.execute(
                    "SELECT cluster_id FROM nodes WHERE id = %s", (asked.target,)
                )
                row = await cursor.fetchone()
                if row is None:
                    raise refuse(404, f"no node {asked.target}")
                cluster_id, tenant_id = str(row[0]), None
            else:
                cursor = await conn.execute(
                    "SELECT p.tenant_id FROM workloads w JOIN projects p ON p.id = w.project_id "
                    "WHERE w.id = %s",
                    (asked.target,),
                )
                row = await cursor.fetchone()
                if row is None or (role is Role.TENANT and row[0] != own):
                    raise refuse(404, f"no workload {asked.target}")  # another's: as absent
                cluster_id, tenant_id = None, str(row[0])
            view = await machinery_sql.create_operation(
                conn,
                kind=asked.kind,
                target=asked.target,
                cluster_id=cluster_id,
                tenant_id=tenant_id,
                requester="admin" if role is Role.ADMIN else str(own),
                reason=asked.reason,
                payload=payload,
            )
        return json_response(view, 201)

    def reader(role: Role, own: str | None) -> tuple[str | None, str | None]:
        """(tenant filter, cluster filter) the caller is held to."""
        if role is Role.TENANT:
            return own, None
        if role is Role.CLUSTER:
            return None, own
        return None, None

    async def listing(request: web.Request) -> web.Response:
        tenant, held = reader(*await server.caller(request))
        cluster = request.query.get("cluster")
        if cluster is not None and not is_id(cluster, "clu"):
            raise refuse(400, "cluster is a clu_ id")
        if held is not None:
            if cluster not in (None, held):
                raise refuse(403, "a cluster token reads its own cluster only")
            cluster = held
        phase = request.query.get("phase")
        if phase is not None and phase not in machinery_sql.PHASE_RANK:
            raise refuse(400, "phase is pending, running, succeeded or failed")
        limit = limit_param(request)
        async with connection(pool) as conn:
            page = await machinery_sql.list_operations(
                conn, tenant_id=tenant, cluster_id=cluster, phase=phase, limit=limit
            )
        return json_response({"items": page})

    async def one(request: web.Request) -> web.Response:
        tenant, held = reader(*await server.caller(request))
        op_id = request.match_info["id"]
        view = None
        if is_id(op_id, "opr"):
            async with connection(pool) as conn:
                view = await machinery_sql.get_operation(conn, op_id, tenant_id=tenant)
        if view is None or (held is not None and view["cluster"] != held):
            raise refuse(404, f"no operation {op_id[:40]!r}")
        return json_response(view)

    app.router.add_post("/v1/operations", create)
    app.router.add_get("/v1/operations", listing)
    app.router.add_get("/v1/operations/{id}", one)
