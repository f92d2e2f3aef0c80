"""The machinery side's read views: events newest first, components per node, and cache
residency per node against each cluster's declared warm set."""

from __future__ import annotations

from typing import Any, Final

from plane.db.connection import Conn

__all__ = ["cache_view", "components_view", "events_view"]


def _where(filters: list[tuple[str, Any]]) -> tuple[str, list[Any]]:
    clauses = [f"{column} = %s" for column, value in filters if value is not None]
    params = [value for _, value in filters if value is not None]
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


async def events_view(
    conn: Conn, *, cluster_id: str | None, kind: str | None, limit: int
) -> list[dict[str, Any]]:
    """Events newest first."""
    where, params = _where([("cluster_id", cluster_id), ("kind", kind)])
    cursor = await conn.execute(
        "SELECT id, cluster_id, node_id, kind, about, message, "
        f"(extract(epoch FROM at) * 1000)::bigint FROM events{where} "
        "ORDER BY at DESC, id DESC LIMIT %s",
        (*params, limit),
    )
    keys = ("id", "cluster", "node", "kind", "about", "message", "at")
    return [dict(zip(keys, row, strict=True)) for row in await cursor.fetchall()]


async def components_view(
    conn: Conn, *, cluster_id: str | None, node_id: str | None
) -> list[dict[str, Any]]:
    """Every node's components (agent, engines) with the version it reports."""
    where, params = _where([("cluster_id", cluster_id), ("node_id", node_id)])
    where = f"{where} AND node_id <> ''" if where else " WHERE node_id <> ''"
    cursor = await conn.execute(
        "SELECT cluster_id, node_id, name, coalesce(observed_version, ''), "
        f"(extract(epoch FROM updated_at) * 1000)::bigint FROM components{where} "
        "ORDER BY cluster_id, node_id, name LIMIT 10000",
        params,
    )
    keys = ("cluster", "node", "name", "version", "updatedAt")
    return [dict(zip(keys, row, strict=True)) for row in await cursor.fetchall()]


_CACHE: Final = """
SELECT c.cluster_id, c.artifact_id,
       bool_or(c.node_id = '' AND c.declared_warm) AS warm,
       coalesce(array_agg(c.node_id ORDER BY c.node_id)
                FILTER (WHERE c.node_id <> '' AND c.resident), ARRAY[]::text[]) AS resident,
       coalesce(array_agg(c.node_id ORDER BY c.node_id)
                FILTER (WHERE c.node_id <> '' AND NOT c.resident AND c.state = 'fetching'),
                ARRAY[]::text[]) AS fetching,
       coalesce(array_agg(c.progress ORDER BY c.node_id)
                FILTER (WHERE c.node_id <> '' AND NOT c.resident AND c.state = 'fetching'),
                ARRAY[]::real[]) AS progress
FROM cache_entries c {where}
GROUP BY c.cluster_id, c.artifact_id
ORDER BY c.cluster_id, c.artifact_id LIMIT 10000
"""


async def cache_view(conn: Conn, *, cluster_id: str | None) -> list[dict[str, Any]]:
    """Per cluster and artifact: whether it is declared warm there, the nodes that hold it
    resident (from their artifact stores), those fetching it (with the share of pieces
    held), and -- for a warm one -- the cluster's nodes that have none of it yet."""
    where = "WHERE c.cluster_id = %s" if cluster_id is not None else ""
    params = [cluster_id] if cluster_id is not None else []
    cursor = await conn.execute(_CACHE.format(where=where), params)
    rows = await cursor.fetchall()
    clusters = sorted({row[0] for row in rows})
    cursor = await conn.execute(
        "SELECT cluster_id, id FROM nodes WHERE cluster_id = ANY(%s) ORDER BY id", (clusters,)
    )
    nodes: dict[str, list[str]] = {}
    for owner, node in await cursor.fetchall():
        nodes.setdefault(owner, []).append(node)
    view = []
    for owner, artifact, warm, resident, fetching, progress in rows:
        entry: dict[str, Any] = {
            "cluster": owner,
            "artifact": artifact,
            "declaredWarm": bool(warm),
            "residentOn": list(resident),
            "fetchingOn": [
                {"node": n, "progress": round(float(p), 2)}
                for n, p in zip(fetching, progress, strict=True)
            ],
        }
        if warm:
            held = {*resident, *fetching}
            entry["missingOn"] = [n for n in nodes.get(owner, []) if n not in held]
        view.append(entry)
    return view
