"""The routing table every cluster fetches (`DesiredState.routes`): each endpoint of every
tenant with its targets, where they run and whether they are ready.

Two queries for the whole table: the endpoints (with their tenants' hosts), then every
deployment they name with its cluster, its name there (the workload's name), whether the
plane holds a ready replica of it on a reachable node (a replica of that deployment, or
one the cluster runs under the same name in a deployment of its own: what its facades
serve under that name), and the facade URLs of that
cluster's reachable nodes (`nodes.facade_url`, which each node's sync reports). A target
whose deployment is gone, or is no longer the endpoint's tenant's, is left out.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec

from plane.db.connection import Conn
from plane.desired.state import Route, RouteTarget

__all__ = ["MAX_ROUTES", "MAX_URLS", "routes"]

log = logging.getLogger(__name__)

MAX_ROUTES: Final = 65_536  # plane.desired.state.DesiredState.routes
MAX_URLS: Final = 64  # plane.desired.state.RouteTarget.urls

_ENDPOINTS: Final = """
SELECT e.id, e.tenant_id, coalesce(lower(t.host), ''), e.model_name, e.mode, e.targets
FROM endpoints e JOIN tenants t ON t.id = e.tenant_id
ORDER BY e.tenant_id, e.model_name
LIMIT %s
"""

_TARGETS: Final = """
SELECT d.id, d.cluster_id, w.name, p.tenant_id,
       EXISTS (SELECT 1 FROM replicas r JOIN nodes rn ON rn.id = r.node_id
               WHERE r.cluster_id = d.cluster_id AND r.state = 'ready' AND rn.reachable
                 AND (r.deployment_id = d.id
                      OR (r.deployment_id IS NULL AND r.deployment_name = w.name))),
       ARRAY(SELECT n.facade_url FROM nodes n
             WHERE n.cluster_id = d.cluster_id AND n.reachable AND n.facade_url <> ''
               AND length(n.facade_url) <= 512
             ORDER BY n.id LIMIT %s)
FROM deployments d
JOIN workloads w ON w.id = d.workload_id
JOIN projects p ON p.id = w.project_id
WHERE d.id = ANY(%s)
"""


async def routes(conn: Conn) -> list[Route]:
    """Every endpoint as a route, by tenant and public name."""
    cursor = await conn.execute(_ENDPOINTS, (MAX_ROUTES,))
    endpoints = await cursor.fetchall()
    named = {str(t["deployment"]) for row in endpoints for t in _targets(row[5])}
    cursor = await conn.execute(_TARGETS, (MAX_URLS, sorted(named)))
    where = {str(row[0]): row for row in await cursor.fetchall()}
    table = []
    for endpoint, tenant, host, model, mode, targets in endpoints:
        resolved = []
        for given in _targets(targets):
            row = where.get(str(given["deployment"]))
            if row is None or row[3] != tenant:
                continue
            resolved.append(
                RouteTarget(
                    deployment=row[0],
                    cluster=row[1],
                    name=row[2],
                    weight=int(given.get("weight", 0)),
                    order=int(given.get("order", 0)),
                    ready=bool(row[4]),
                    urls=list(row[5]),
                )
            )
        route = {
            "endpoint": endpoint,
            "tenant": tenant,
            "host": host,
            "model": model,
            "mode": mode,
            "targets": [msgspec.to_builtins(t) for t in resolved],
        }
        try:  # the wire's own checks: one odd row must not spoil every cluster's document
            table.append(msgspec.convert(route, Route))
        except msgspec.ValidationError as exc:
            log.warning("endpoint %s left out of the routes: %s", endpoint, exc)
    return table


def _targets(value: Any) -> list[dict[str, Any]]:
    """An endpoint's stored targets (written by plane.desired.endpoints_api, so well-formed)."""
    return (
        [t for t in value if isinstance(t, dict) and "deployment" in t]
        if isinstance(value, list)
        else []
    )
