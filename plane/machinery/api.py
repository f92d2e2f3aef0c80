"""The machinery side's read routes and the warm set over HTTP (docs/plane-operations.md).

    GET /v1/events?cluster=&kind=&limit=      admin, or a cluster (its own) -> newest first
    GET /v1/components?cluster=&node=         admin, or a cluster (its own)
    GET /v1/cache?cluster=                    admin, or a cluster (its own): residency per
                                              node against the declared warm set
    PUT /v1/clusters/{id}/warm {artifacts}    admin: declare the cluster's warm set

Nodes, their components and their caches are the fleet's supply side: a tenant key reads
none of them (403), as with the fleet summary.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from aiohttp import web
from msgspec import Meta, Struct

from plane.core.ids import is_id
from plane.core.roles import Role
from plane.db.connection import connection
from plane.http.answers import JsonBody, json_answer, refusal
from plane.http.context import ApiContext
from plane.machinery import sql as machinery_sql
from plane.machinery import views as machinery_views
from plane.machinery.operations_api import MAX_REQUEST, limit_param

__all__ = ["WarmRequest", "mount"]

_ART: Final = r"^art_[0-9a-hjkmnp-tv-z]{26}$"
_KIND: Final = re.compile(r"^[a-z][a-z0-9-]{0,63}$")


class WarmRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PUT /v1/clusters/{id}/warm`: the whole warm set (an empty list clears it)."""

    artifacts: Annotated[list[Annotated[str, Meta(pattern=_ART)]], Meta(max_length=4096)]


_WARM: Final = JsonBody(
    WarmRequest,
    most=MAX_REQUEST * 16,
    too_large="the warm set's body is too large",
    invalid=lambda why: f"invalid warm set: {why}",
    malformed='the body is {"artifacts": ["art_...", ...]}',
    refuse=refusal,
)


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the events, components, cache and warm-set routes, served over `context`."""
    pool = context.pool

    async def scope(request: web.Request) -> str | None:
        """The cluster the caller reads: the admin any (the `cluster` parameter, or all), a
        cluster token its own only."""
        role, own = await context.caller(request)
        if role is Role.TENANT:
            raise refusal(403, "a tenant key reads its own tenant's objects only")
        cluster = request.query.get("cluster")
        if cluster is not None and not is_id(cluster, "clu"):
            raise refusal(400, "cluster is a clu_ id")
        if role is Role.CLUSTER:
            if cluster not in (None, own):
                raise refusal(403, "a cluster token reads its own cluster only")
            return str(own)
        return cluster

    async def events(request: web.Request) -> web.Response:
        cluster = await scope(request)
        kind = request.query.get("kind")
        if kind is not None and not _KIND.match(kind):
            raise refusal(400, "kind is an event kind such as node-joined")
        limit = limit_param(request)
        async with connection(pool) as conn:
            page = await machinery_views.events_view(
                conn, cluster_id=cluster, kind=kind, limit=limit
            )
        return json_answer({"items": page})

    async def components(request: web.Request) -> web.Response:
        cluster = await scope(request)
        node = request.query.get("node")
        if node is not None and not is_id(node, "nod"):
            raise refusal(400, "node is a nod_ id")
        async with connection(pool) as conn:
            rows = await machinery_views.components_view(conn, cluster_id=cluster, node_id=node)
        return json_answer({"items": rows})

    async def cache(request: web.Request) -> web.Response:
        cluster = await scope(request)
        async with connection(pool) as conn:
            rows = await machinery_views.cache_view(conn, cluster_id=cluster)
        return json_answer({"items": rows})

    async def warm(request: web.Request) -> web.Response:
        await context.admin(request)
        cluster = request.match_info["id"]
        asked = await _WARM.read(request)
        async with connection(pool) as conn:
            cursor = await conn.execute("SELECT 1 FROM clusters WHERE id = %s", (cluster,))
            if not is_id(cluster, "clu") or await cursor.fetchone() is None:
                raise refusal(404, f"no cluster {cluster[:40]!r}")
            unknown = await machinery_sql.set_warm(conn, cluster, asked.artifacts)
        if unknown:
            raise refusal(404, f"no artifact {', '.join(unknown[:5])}")
        return json_answer({"cluster": cluster, "artifacts": sorted(set(asked.artifacts))})

    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/components", components)
    app.router.add_get("/v1/cache", cache)
    app.router.add_put("/v1/clusters/{id}/warm", warm)
