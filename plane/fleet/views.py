"""The plane's read side: clusters, the fleet summary, pages of jobs.

Functions over one connection; `PlaneStore` takes the connection and translates errors. The
fleet summary reads the rollups the sync keeps (migration 0002), never the jobs themselves.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Final

from plane.db.connection import Conn
from plane.fleet.usage import usage_summary

__all__ = ["STALE_AFTER", "clusters", "fleet_summary", "jobs_page"]

STALE_AFTER: Final = datetime.timedelta(seconds=30)  # a node that has not synced is unreachable

_JOB_FIELDS: Final = (
    "createdAt",
    "clusterId",
    "originatedFrom",
    "runId",
    "id",
    "seq",
    "state",
    "model",
    "engine",
    "scheduledOn",
    "requesterId",
    "startedAt",
    "completedAt",
    "error",
)
_SELECT_JOBS: Final = (
    "SELECT created_at, cluster_id, origin, run_id, id, seq, state, model, engine, "
    "scheduled_on, requester_id, started_at, completed_at, error FROM jobs "
)
_NEWEST_FIRST: Final = (
    " ORDER BY created_at DESC, cluster_id DESC, origin DESC, run_id DESC, id DESC LIMIT %s"
)


async def clusters(conn: Conn) -> list[dict[str, Any]]:
    """Every enrolled cluster, revoked ones included, by name."""
    cursor = await conn.execute(
        "SELECT id, name, created_at, last_sync_at, revoked_at, region, residency, "
        "cost_per_device_hour FROM clusters ORDER BY name"
    )
    return [
        {
            "id": r[0],
            "name": r[1],
            "createdAt": _iso(r[2]),
            "lastSyncAt": _iso(r[3]),
            "revokedAt": _iso(r[4]),
            # The declared attributes policies test (PATCH /v1/clusters/{id}).
            "region": r[5],
            "residency": r[6],
            "costPerDeviceHour": r[7],
        }
        for r in await cursor.fetchall()
    ]


async def fleet_summary(
    conn: Conn, *, window_s: int = 3600, cluster_id: str | None = None
) -> dict[str, Any]:
    """Clusters with nodes, GPUs by class and health, memory, jobs by state; for the fleet
    (or the one cluster asked for) jobs by model and queue and run time percentiles over the
    window."""
    where, args = ("WHERE c.id = %s", [cluster_id]) if cluster_id else ("", [])
    nodes = await (
        await conn.execute(
            "SELECT c.id, c.name, "
            " count(n.id) FILTER (WHERE n.updated_at > now() - %s),"
            " count(n.id) FILTER (WHERE n.updated_at <= now() - %s),"
            " count(n.id) FILTER (WHERE n.cordoned) "
            f"FROM clusters c LEFT JOIN nodes n ON n.cluster_id = c.id {where} "
            "GROUP BY c.id, c.name ORDER BY c.name",
            [STALE_AFTER, STALE_AFTER, *args],
        )
    ).fetchall()
    devices = await (
        await conn.execute(
            "SELECT cluster_id, device_class, health, count(*), sum(memory_total), "
            f"sum(memory_used) FROM devices {'WHERE cluster_id = %s' if cluster_id else ''} "
            "GROUP BY 1, 2, 3",
            args,
        )
    ).fetchall()
    first_hour = int((datetime.datetime.now(datetime.UTC).timestamp() - window_s) // 3600)
    only = "AND cluster_id = %s" if cluster_id else ""
    by_state = await (
        await conn.execute(
            f"SELECT cluster_id, state, sum(jobs) FROM job_rollup WHERE jobs > 0 {only} "
            "GROUP BY 1, 2",
            args,
        )
    ).fetchall()
    # By model and the time percentiles: for the whole fleet (or the one cluster asked
    # for). Per cluster they would be clusters x models rows on every call.
    by_model = await (
        await conn.execute(
            f"SELECT model, sum(jobs) FROM job_rollup WHERE jobs > 0 {only} GROUP BY 1", args
        )
    ).fetchall()
    timing = await (
        await conn.execute(
            "WITH t AS (SELECT kind, bucket, sum(jobs) AS n FROM job_timing "
            f"  WHERE hour >= %s {only} GROUP BY 1, 2),"
            " c AS (SELECT kind, bucket,"
            "  sum(n) OVER (PARTITION BY kind ORDER BY bucket) AS running,"
            "  sum(n) OVER (PARTITION BY kind) AS total FROM t) "
            "SELECT kind,"
            " min(bucket) FILTER (WHERE running >= 0.5 * total),"
            " min(bucket) FILTER (WHERE running >= 0.95 * total),"
            " min(bucket) FILTER (WHERE running >= 0.99 * total) "
            "FROM c GROUP BY 1",
            [first_hour, *args],
        )
    ).fetchall()
    summary = _summary(window_s, nodes, devices, by_state, by_model, timing)
    summary["jobs"]["usage"] = await usage_summary(conn, cluster_id)  # tokens by model, key
    return summary


def _summary(
    window_s: int,
    nodes: Sequence[tuple[Any, ...]],
    devices: Sequence[tuple[Any, ...]],
    by_state: Sequence[tuple[Any, ...]],
    by_model: Sequence[tuple[Any, ...]],
    timing: Sequence[tuple[Any, ...]],
) -> dict[str, Any]:
    """The summary's JSON shape from the rows of the queries."""
    summary: dict[str, dict[str, Any]] = {}
    for cid, name, reachable, unreachable, cordoned in nodes:
        summary[cid] = {
            "id": cid,
            "name": name,
            "nodes": {"reachable": reachable, "unreachable": unreachable, "cordoned": cordoned},
            "gpus": {},
            "memory": {"total": 0, "used": 0, "free": 0},
            "jobs": {"byState": {}},
        }
    for cid, cls, health, count, total, used in devices:
        entry = summary.get(cid)
        if entry is None:
            continue
        entry["gpus"].setdefault(cls, {})[health] = count
        entry["memory"]["total"] += int(total or 0)
        entry["memory"]["used"] += int(used or 0)
    for entry in summary.values():
        entry["memory"]["free"] = entry["memory"]["total"] - entry["memory"]["used"]
    for cid, state, count in by_state:
        if cid in summary:
            summary[cid]["jobs"]["byState"][state] = int(count)
    percentiles: dict[str, dict[str, float] | None] = {"queueMs": None, "runMs": None}
    for kind, *buckets in timing:
        # Each percentile is its bucket's upper edge: within ~10 % of the true value.
        edges = [round(1.1 ** (b + 1) - 1, 1) for b in buckets]
        percentiles["queueMs" if kind == "q" else "runMs"] = dict(
            zip(("p50", "p95", "p99"), edges, strict=True)
        )
    jobs_by_state: dict[str, int] = {}
    for entry in summary.values():
        for state, count in entry["jobs"]["byState"].items():
            jobs_by_state[state] = jobs_by_state.get(state, 0) + count
    return {
        "windowS": window_s,
        "jobs": {
            "byState": jobs_by_state,
            "byModel": {model: int(count) for model, count in by_model},
            **percentiles,
        },
        "clusters": list(summary.values()),
    }


async def jobs_page(
    conn: Conn,
    *,
    cluster_id: str | None,
    state: str | None,
    model: str | None,
    after: Sequence[Any] | None,
    limit: int,
) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """Jobs newest first with keyset pagination; returns the page and the next cursor
    (None on the last page)."""
    clauses, args = [], []
    for column, value in (("cluster_id", cluster_id), ("state", state), ("model", model)):
        if value is not None:
            clauses.append(f"{column} = %s")
            args.append(value)
    if after is not None:
        clauses.append("(created_at, cluster_id, origin, run_id, id) < (%s, %s, %s, %s, %s)")
        args.extend(after)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    cursor = await conn.execute(_SELECT_JOBS + where + _NEWEST_FIRST, [*args, limit])
    rows = await cursor.fetchall()
    page = [dict(zip(_JOB_FIELDS, r, strict=True)) for r in rows]
    cursor_next = list(rows[-1][:5]) if len(rows) == limit else None
    return page, cursor_next


def _iso(value: datetime.datetime | None) -> str | None:
    return value.isoformat() if value else None
