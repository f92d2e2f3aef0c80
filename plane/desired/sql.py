"""The SQL of the desired-state channel: one cluster's `DesiredState` (its deployments,
every endpoint's route, its operations and warm set) and the deployments' listing with
their replicas as the nodes report them (`plane.desired.api`)."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from facts.deployments import Constraints
from plane.core.errors import PlaneError
from plane.core.ids import new_id
from plane.db.connection import Conn
from plane.desired.routes_sql import routes
from plane.desired.state import DesiredDeployment, DesiredState
from plane.machinery.sql import pending_operations, warm_set
from plane.placement.apportion import min_shares

__all__ = ["declare_observed", "deployment_of", "deployments_of", "desired_state"]

# The workload's serving configuration gives the engine and how it runs; what the engine
# loads is its `source`, else the artifact's first storage location.
_COLUMNS: Final = b"""
SELECT d.id, w.id, w.name, w.serving, coalesce(a.locations[1], ''), d.replicas,
       w.constraints, d.authority, d.url, d.node, w.paused, w.on_load, w.min_replicas,
       d.cluster_id,
       CASE WHEN w.on_load THEN (SELECT json_object_agg(o.cluster_id, o.replicas)
                                 FROM deployments o WHERE o.workload_id = w.id) END
FROM deployments d
JOIN workloads w ON w.id = d.workload_id
JOIN artifacts a ON a.id = w.artifact_id
"""
_DESIRED: Final = _COLUMNS + b"WHERE d.cluster_id = %s ORDER BY w.name"


_ONE: Final = (
    _COLUMNS
    + b"JOIN projects p ON p.id = w.project_id "
    + b"WHERE d.id = %s AND (%s::text IS NULL OR p.tenant_id = %s)"
)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def desired_deployment(row: tuple[Any, ...]) -> DesiredDeployment:
    """One `_DESIRED` row as the wire says it. A serving configuration is the workload
    API's to validate; here a missing or odd field takes the wire's default."""
    dep_id, wkl_id, name, serving, source, replicas, constraints, authority, url, node = row[:10]
    paused, on_load, low, cluster_id, shares = row[10:]
    serving = serving if isinstance(serving, dict) else {}
    constraints = constraints if isinstance(constraints, dict) else {}
    args = serving.get("args")
    gpus = _int(serving.get("gpus"), 1)
    return msgspec.convert(
        {
            "id": dep_id,
            "workload": wkl_id,
            "name": name,
            "engine": str(serving.get("engine") or "vllm"),
            "source": str(serving.get("source") or "") or source,
            "args": [str(a) for a in args] if isinstance(args, list) else [],
            "gpus": gpus,
            "tp": _int(serving.get("tp"), max(1, gpus)),
            "replicas": 0 if paused else replicas,
            "maxInFlight": _int(serving.get("maxInFlight"), 0),
            "constraints": Constraints(
                deviceClass=str(constraints.get("deviceClass") or ""),
                oneDomain=bool(constraints.get("oneDomain")),
                minMemory=_int(constraints.get("minMemory"), 0),
            ),
            "authority": authority,
            "url": url,
            "node": node,
            "paused": bool(paused),
            **({"minReplicas": _min_share(shares, int(low), cluster_id)} if on_load else {}),
        },
        DesiredDeployment,
    )


def _min_share(shares: Any, low: int, cluster_id: str) -> int:
    """This cluster's part of a workload on load's minReplicas, over every cluster's share
    of its max (`plane.placement.apportion.min_shares`: the same on every read)."""
    held = {str(c): int(n) for c, n in shares.items()} if isinstance(shares, dict) else {}
    return min_shares(held, low).get(cluster_id, 0)


async def desired_state(conn: Conn, cluster_id: str) -> DesiredState:
    """Everything the plane wants of `cluster_id` now, read in one snapshot."""
    async with conn.transaction():
        await conn.execute(b"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cursor = await conn.execute(
            b"SELECT desired_generation FROM clusters WHERE id = %s", (cluster_id,)
        )
        row = await cursor.fetchone()
        generation = 0 if row is None else int(row[0])
        cursor = await conn.execute(_DESIRED, (cluster_id,))
        deployments = [desired_deployment(r) for r in await cursor.fetchall()]
        return DesiredState(
            cluster=cluster_id,
            generation=generation,
            deployments=deployments,
            routes=await routes(conn),
            operations=await pending_operations(conn, cluster_id),
            warm=await warm_set(conn, cluster_id),
        )


async def deployment_of(
    conn: Conn, deployment_id: str, *, tenant: str | None
) -> DesiredDeployment | None:
    """One plane deployment as its cluster receives it; None when there is none, or it is
    not `tenant`'s (None: the admin, who sees every tenant's)."""
    cursor = await conn.execute(_ONE, (deployment_id, tenant, tenant))
    row = await cursor.fetchone()
    return None if row is None else desired_deployment(row)


_LIST: Final = """
SELECT d.id, d.workload_id, w.name, d.cluster_id, c.name, d.replicas, d.authority, d.url,
       d.node, w.paused,
       coalesce(json_agg(json_build_object(
           'id', r.id, 'node', r.node_id, 'state', r.state, 'ready', r.ready,
           'drift', r.drift, 'engineVersion', coalesce(r.engine_version, ''))
           ORDER BY r.id) FILTER (WHERE r.id IS NOT NULL), '[]')
FROM deployments d
JOIN workloads w ON w.id = d.workload_id
JOIN projects p ON p.id = w.project_id
JOIN clusters c ON c.id = d.cluster_id
LEFT JOIN replicas r ON r.deployment_id = d.id
WHERE (%(tenant)s::text IS NULL OR p.tenant_id = %(tenant)s)
  AND (%(workload)s::text IS NULL OR d.workload_id = %(workload)s OR w.name = %(workload)s)
  AND (%(cluster)s::text IS NULL OR d.cluster_id = %(cluster)s OR c.name = %(cluster)s)
GROUP BY d.id, w.name, c.name, w.paused
ORDER BY w.name, c.name
LIMIT 10000
"""


async def deployments_of(
    conn: Conn, *, tenant: str | None, workload: str | None, cluster: str | None
) -> list[dict[str, Any]]:
    """The deployments (a tenant's own, or all for `tenant=None`) with their replicas."""
    params = {"tenant": tenant, "workload": workload, "cluster": cluster}
    cursor = await conn.execute(_LIST.encode(), params)
    out = []
    for row in await cursor.fetchall():
        dep, wkl, name, clu, cname, replicas, authority, url, node, paused, reps = row
        drift = sorted({r["drift"] for r in reps if r["drift"]})
        out.append(
            {
                "id": dep,
                "workload": wkl,
                "name": name,
                "cluster": clu,
                "clusterName": cname,
                "replicas": replicas,
                "authority": authority,
                "url": url,
                "node": node,
                "paused": paused,
                "ready": sum(1 for r in reps if r["state"] == "ready"),
                "states": _count(r["state"] for r in reps),
                "drift": drift,
                "observed": reps,
            }
        )
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


async def declare_observed(
    conn: Conn, *, tenant: str | None, workload: str, cluster: str, url: str, node: str
) -> dict[str, Any]:
    """Declare the `observed` deployment of `workload` on `cluster`: the engine at `url` on
    `node` is adopted, never started or stopped. 404 for a workload or cluster not there (or
    another tenant's workload); 409 when the workload already has a deployment there."""
    cursor = await conn.execute(
        b"SELECT w.id FROM workloads w JOIN projects p ON p.id = w.project_id "
        b"WHERE (w.id = %s OR w.name = %s) AND (%s::text IS NULL OR p.tenant_id = %s)",
        (workload, workload, tenant, tenant),
    )
    row = await cursor.fetchone()
    if row is None:
        raise NotFound(f"no workload {workload!r}")
    wkl_id = row[0]
    cursor = await conn.execute(
        b"SELECT id FROM clusters WHERE (id = %s OR name = %s) AND revoked_at IS NULL",
        (cluster, cluster),
    )
    row = await cursor.fetchone()
    if row is None:
        raise NotFound(f"no cluster {cluster!r}")
    clu_id = row[0]
    dep_id = new_id("dep")
    async with conn.transaction():
        await conn.execute(
            b"INSERT INTO deployments (id, workload_id, cluster_id, replicas, authority, url, node)"
            b" VALUES (%s, %s, %s, 1, 'observed', %s, %s)",
            (dep_id, wkl_id, clu_id, url, node),
        )
        await conn.execute(
            b"UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = %s",
            (clu_id,),
        )
    return {"id": dep_id, "workload": wkl_id, "cluster": clu_id, "authority": "observed"}


class NotFound(PlaneError):
    """No such object (or another tenant's: the same answer)."""

    status = 404
