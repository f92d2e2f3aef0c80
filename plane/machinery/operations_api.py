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

from aiohttp import web
from msgspec import Meta, Struct

from plane.core.ids import is_id
from plane.core.roles import Role
from plane.db.connection import connection
from plane.http.answers import JsonBody, json_answer, refusal
from plane.http.context import ApiContext
from plane.machinery import sql as machinery_sql

__all__ = ["OperationRequest", "limit_param", "mount"]

MAX_REQUEST: Final = 16_384


class OperationRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/operations`."""

    kind: Literal["drain", "cordon", "uncordon", "scale", "pause", "resume"]
    target: Annotated[str, Meta(max_length=64)]
    reason: Annotated[str, Meta(max_length=500, pattern=r"^[^\x00]*$")] = ""
    force: bool = False
    timeoutS: Annotated[float, Meta(gt=0, le=86_400)] = 300.0
    replicas: Annotated[int, Meta(ge=0, le=1024)] | None = None


# The machinery's route groups refuse with aiohttp's errors (`refusal`), bodies included.
_OPERATION: Final = JsonBody(
    OperationRequest,
    most=MAX_REQUEST,
    too_large=f"the body is at most {MAX_REQUEST} bytes",
    invalid=lambda why: f"invalid operation: {why}",
    malformed="the body is a JSON operation: {kind, target, ...}",
    refuse=refusal,
)


def limit_param(request: web.Request, default: int = 100, most: int = 1000) -> int:
    """The `limit` query parameter, 1 to `most`; 400 when it is not a number."""
    text = request.query.get("limit", str(default)).strip()
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise refusal(400, f"limit is a number from 1 to {most}")
    return max(1, min(int(text), most))


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the operations routes, served over `context`."""
    pool = context.pool

    async def create(request: web.Request) -> web.Response:
        role, own = await context.caller(request)
        if role is Role.CLUSTER:
            raise refusal(403, "a cluster token cannot start plane operations")
        asked = await _OPERATION.read(request)
        node_kind = asked.kind in machinery_sql.NODE_KINDS
        prefix = "nod" if node_kind else "wkl"
        if not is_id(asked.target, prefix):
            raise refusal(400, f"target of a {asked.kind} is a {prefix}_ id (at `$.target`)")
        if asked.kind == "scale" and asked.replicas is None:
            raise refusal(400, "a scale needs replicas (at `$.replicas`)")
        if asked.kind != "scale" and asked.replicas is not None:
            raise refusal(400, f"a {asked.kind} takes no replicas (at `$.replicas`)")
        if node_kind and role is not Role.ADMIN:
            raise refusal(403, f"a {asked.kind} needs the admin token")
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
                    raise refusal(404, f"no node {asked.target}")
                cluster_id, tenant_id = str(row[0]), None
            else:
                cursor = await conn.execute(
                    "SELECT p.tenant_id FROM workloads w JOIN projects p ON p.id = w.project_id "
                    "WHERE w.id = %s",
                    (asked.target,),
                )
                row = await cursor.fetchone()
                if row is None or (role is Role.TENANT and row[0] != own):
                    raise refusal(404, f"no workload {asked.target}")  # another's: as absent
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
        return json_answer(view, 201)

    def reader(role: Role, own: str | None) -> tuple[str | None, str | None]:
        """(tenant filter, cluster filter) the caller is held to."""
        if role is Role.TENANT:
            return own, None
        if role is Role.CLUSTER:
            return None, own
        return None, None

    async def listing(request: web.Request) -> web.Response:
        tenant, held = reader(*await context.caller(request))
        cluster = request.query.get("cluster")
        if cluster is not None and not is_id(cluster, "clu"):
            raise refusal(400, "cluster is a clu_ id")
        if held is not None:
            if cluster not in (None, held):
                raise refusal(403, "a cluster token reads its own cluster only")
            cluster = held
        phase = request.query.get("phase")
        if phase is not None and phase not in machinery_sql.PHASE_RANK:
            raise refusal(400, "phase is pending, running, succeeded or failed")
        limit = limit_param(request)
        async with connection(pool) as conn:
            page = await machinery_sql.list_operations(
                conn, tenant_id=tenant, cluster_id=cluster, phase=phase, limit=limit
            )
        return json_answer({"items": page})

    async def one(request: web.Request) -> web.Response:
        tenant, held = reader(*await context.caller(request))
        op_id = request.match_info["id"]
        view = None
        if is_id(op_id, "opr"):
            async with connection(pool) as conn:
                view = await machinery_sql.get_operation(conn, op_id, tenant_id=tenant)
        if view is None or (held is not None and view["cluster"] != held):
            raise refusal(404, f"no operation {op_id[:40]!r}")
        return json_answer(view)

    app.router.add_post("/v1/operations", create)
    app.router.add_get("/v1/operations", listing)
    app.router.add_get("/v1/operations/{id}", one)
