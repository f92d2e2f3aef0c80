"""The desired-state channel's routes (mounted through `plane.http.mounts`).

    GET  /v1/desired                    cluster -> its DesiredState; ETag, If-None-Match -> 304
    GET  /v1/deployments?workload=&cluster=   admin: all; tenant: its own workloads'
    POST /v1/deployments {workload, cluster, url, node}   admin or the workload's tenant:
                                        an `observed` deployment adopting a running engine

The ETag is a hash of the encoded document, so an unchanged state costs one small answer
whatever changed it (or did not) in the tables behind it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Final

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from plane.core.roles import Role
from plane.db.connection import connection
from plane.desired.sql import declare_observed, deployments_of, desired_state
from plane.http.answers import JsonBody, json_answer, refusal
from plane.http.context import ApiContext

__all__ = ["ObservedRequest", "mount"]


class ObservedRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/deployments`: adopt the engine at `url` on `node` for `workload`."""

    workload: Annotated[str, Meta(min_length=1, max_length=128)]
    cluster: Annotated[str, Meta(min_length=1, max_length=128)]
    url: Annotated[str, Meta(min_length=1, max_length=2048, pattern=r"^https?://[^\x00\s]+$")]
    node: Annotated[str, Meta(max_length=256, pattern=r"^[^\x00]*$")] = ""


_OBSERVED: Final = JsonBody(
    ObservedRequest, malformed=lambda why: f"bad observed deployment: {why}"
)


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the desired-state routes to `app`, served over `context`."""

    async def desired(request: web.Request) -> web.Response:
        role, cluster = await context.caller(request)
        if role is not Role.CLUSTER or cluster is None:
            raise refusal(403, "only a cluster token fetches its desired state")
        async with connection(context.pool) as conn:
            state = await desired_state(conn, cluster)
        body = msgspec.json.encode(state)
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        if etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(body=body, content_type="application/json", headers={"ETag": etag})

    async def listing(request: web.Request) -> web.Response:
        role, own = await context.caller(request)
        if role is Role.CLUSTER:
            raise refusal(403, "the deployments listing is the admin's or a tenant's")
        query = request.query
        async with connection(context.pool) as conn:
            rows = await deployments_of(
                conn,
                tenant=own if role is Role.TENANT else None,
                workload=query.get("workload") or None,
                cluster=query.get("cluster") or None,
            )
        return json_answer({"items": rows})

    async def observe(request: web.Request) -> web.Response:
        role, own = await context.caller(request)
        if role is Role.CLUSTER:
            raise refusal(403, "deployments are declared by the admin or a tenant")
        body = await _OBSERVED.read(request)
        async with connection(context.pool) as conn:
            made = await declare_observed(
                conn,
                tenant=own if role is Role.TENANT else None,
                workload=body.workload,
                cluster=body.cluster,
                url=body.url,
                node=body.node,
            )
        return json_answer(made, 201)

    app.router.add_get("/v1/desired", desired)
    app.router.add_get("/v1/deployments", listing)
    app.router.add_post("/v1/deployments", observe)
