"""Plane operations and the declared warm set in PostgreSQL: what a cluster is asked to
carry out (`DesiredState.operations`) and keep warm (`DesiredState.warm`).

An operation's phases only move forward (`PHASE_RANK`): pending -> running -> succeeded |
failed, and pending -> failed. A node-targeted one (drain, cordon, uncordon) belongs to the
target node's cluster and is listed in that cluster's desired state until it is final; a
workload-targeted one (scale, pause, resume) is carried out in the plane, in the request's
own transaction (`plane.placement.workload_ops`), and is final when it is stored.
"""

from __future__ import annotations

from typing import Any, Final

from psycopg.types.json import Jsonb

from plane.core.errors import PlaneError
from plane.core.ids import new_id
from plane.db.connection import Conn
from plane.desired.state import DesiredOperation, WarmArtifact
from plane.placement import workload_ops

__all__ = [
    "FINAL",
    "NODE_KINDS",
    "PHASE_RANK",
    "WORKLOAD_KINDS",
    "bump_generation",
    "create_operation",
    "get_operation",
    "list_operations",
    "pending_operations",
    "set_warm",
    "warm_set",
]

NODE_KINDS: Final = ("drain", "cordon", "uncordon")
WORKLOAD_KINDS: Final = ("scale", "pause", "resume")
PHASE_RANK: Final = {"pending": 0, "running": 1, "succeeded": 2, "failed": 2}
FINAL: Final = ("succeeded", "failed")

_COLUMNS: Final = (
    "id, kind, target, cluster_id, tenant_id, requester, reason, phase, result, payload, "
    "(extract(epoch FROM created_at) * 1000)::bigint, "
    "(extract(epoch FROM updated_at) * 1000)::bigint"
)


def _view(row: tuple[Any, ...]) -> dict[str, Any]:
    payload = row[9] or {}
    view: dict[str, Any] = {
        "id": row[0],
        "kind": row[1],
        "target": row[2],
        "cluster": row[3],
        "tenant": row[4],
        "requester": row[5],
        "reason": row[6],
        "phase": row[7],
        "result": row[8],
        "force": bool(payload.get("force", False)),
        "timeoutS": float(payload.get("timeoutS", 300.0)),
        "createdAt": row[10],
        "updatedAt": row[11],
    }
    if "replicas" in payload:
        view["replicas"] = payload["replicas"]
    return view


async def bump_generation(conn: Conn, cluster_id: str) -> None:
    """The cluster's desired state changed: a cluster holding the old generation fetches."""
    await conn.execute(
        "UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = %s",
        (cluster_id,),
    )


async def create_operation(
    conn: Conn,
    *,
    kind: str,
    target: str,
    cluster_id: str | None,
    tenant_id: str | None,
    requester: str,
    reason: str,
    payload: dict[str, Any],
) -> dict[str, Any]:
    """Store a new operation; a workload one is carried out here and stored final (failed
    with the error's words when `workload_ops` refuses it). Returns its view."""
    op_id = new_id("opr")
    phase, result = "pending", None
    async with conn.transaction():
        if kind in WORKLOAD_KINDS:
            try:
                async with conn.transaction():  # a savepoint: a refusal undoes only itself
                    if kind == "scale":
                        await workload_ops.scale_workload(conn, target, int(payload["replicas"]))
                        result = f"scaled to {payload['replicas']} replica(s)"
                    else:
                        await workload_ops.pause_workload(conn, target, kind == "pause")
                        result = "paused" if kind == "pause" else "resumed"
                phase = "succeeded"
            except PlaneError as exc:
                phase, result = "failed", f"{type(exc).__name__}: {exc}"[:500]
        cursor = await conn.execute(
            f"INSERT INTO operations (id, kind, target, cluster_id, tenant_id, requester, "
            f"reason, phase, result, payload) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
            f"RETURNING {_COLUMNS}",
            (op_id, kind, target, cluster_id, tenant_id, requester, reason, phase, result,
             Jsonb(payload)),
        )  # fmt: skip
        row = await cursor.fetchone()
        assert row is not None  # RETURNING of an INSERT that happened
        if cluster_id is not None:
            await bump_generation(conn, cluster_id)
    return _view(row)


def _visible(tenant_id: str | None) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause for who reads: the admin or a cluster (None) sees any; a tenant its
    own operations only."""
    if tenant_id is None:
        return "true", ()
    return "tenant_id = %s", (tenant_id,)


async def get_operation(conn: Conn, op_id: str, *, tenant_id: str | None) -> dict[str, Any] | None:
    """One operation, or None (absent, or another tenant's)."""
    where, args = _visible(tenant_id)
    cursor = await conn.execute(
        f"SELECT {_COLUMNS} FROM operations WHERE id = %s AND {where}", (op_id, *args)
    )
    row = await cursor.fetchone()
    return None if row is None else _view(row)


async def list_operations(
    conn: Conn,
    *,
    tenant_id: str | None,
    cluster_id: str | None,
    phase: str | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Operations newest first, filtered by cluster and phase."""
    where, args = _visible(tenant_id)
    clauses, params = [where], list(args)
    if cluster_id is not None:
        clauses.append("cluster_id = %s")
        params.append(cluster_id)
    if phase is not None:
        clauses.append("phase = %s")
        params.append(phase)
    cursor = await conn.execute(
        f"SELECT {_COLUMNS} FROM operations WHERE {' AND '.join(clauses)} "
        f"ORDER BY created_at DESC, id DESC LIMIT %s",
        (*params, limit),
    )
    return [_view(row) for row in await cursor.fetchall()]


async def pending_operations(conn: Conn, cluster_id: str) -> list[DesiredOperation]:
    """The operations `cluster_id` should carry out now: pending or running, oldest first."""
    cursor = await conn.execute(
        "SELECT id, kind, target, requester, reason, payload FROM operations "
        "WHERE cluster_id = %s AND phase IN ('pending', 'running') AND kind = ANY(%s) "
        "ORDER BY created_at, id LIMIT 1024",
        (cluster_id, list(NODE_KINDS)),
    )
    return [
        DesiredOperation(
            id=row[0],
            kind=row[1],
            target=row[2],
            requester=row[3],
            reason=row[4],
            force=bool((row[5] or {}).get("force", False)),
            timeoutS=float((row[5] or {}).get("timeoutS", 300.0)),
        )
        for row in await cursor.fetchall()
    ]


async def set_warm(conn: Conn, cluster_id: str, artifacts: list[str]) -> list[str]:
    """Declare `cluster_id`'s warm set (replacing the old one); returns the artifact ids it
    does not know (nothing is written then)."""
    wanted = sorted(set(artifacts))
    async with conn.transaction():
        cursor = await conn.execute(
            "SELECT u.id FROM unnest(%s::text[]) AS u(id) "
            "WHERE NOT EXISTS (SELECT 1 FROM artifacts a WHERE a.id = u.id) ORDER BY 1",
            (wanted,),
        )
        unknown = [str(row[0]) for row in await cursor.fetchall()]
        if unknown:
            return unknown
        await conn.execute(
            "DELETE FROM cache_entries WHERE cluster_id = %s AND node_id = '' "
            "AND NOT (artifact_id = ANY(%s))",
            (cluster_id, wanted),
        )
        await conn.execute(
            "INSERT INTO cache_entries (artifact_id, cluster_id, node_id, resident, "
            "declared_warm) SELECT u.id, %s, '', false, true FROM unnest(%s::text[]) AS u(id) "
            "ON CONFLICT (artifact_id, cluster_id, node_id) DO UPDATE SET "
            "declared_warm = true, updated_at = now()",
            (cluster_id, wanted),
        )
        await bump_generation(conn, cluster_id)
    return []


async def warm_set(conn: Conn, cluster_id: str) -> list[WarmArtifact]:
    """The artifacts declared warm on `cluster_id`."""
    cursor = await conn.execute(
        "SELECT a.id, a.digest, a.locations FROM cache_entries c "
        "JOIN artifacts a ON a.id = c.artifact_id "
        "WHERE c.cluster_id = %s AND c.node_id = '' AND c.declared_warm ORDER BY a.id LIMIT 4096",
        (cluster_id,),
    )
    return [
        WarmArtifact(artifact=row[0], digest=row[1][:128], locations=list(row[2] or [])[:16])
        for row in await cursor.fetchall()
    ]
