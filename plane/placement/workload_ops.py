"""Changes to a workload's scale that placement carries out: a scale operation, a pause."""

from __future__ import annotations

from plane.db.connection import Conn
from plane.declared.workloads import check_scale
from plane.placement.sql import (
    WorkloadNotFound,
    bump_generations,
    load_workload,
    place,
    remove_deployments,
)

__all__ = ["pause_workload", "remove_workload", "scale_workload", "set_bounds"]


async def scale_workload(conn: Conn, workload_id: str, replicas: int) -> None:
    """Set the workload's replicas and re-place only the delta, in the caller's transaction;
    `BadInput` outside its scale bounds, `Conflict` past a quota (naming it)."""
    workload = await load_workload(conn, workload_id, lock=True)
    row = await (
        await conn.execute(
            b"SELECT min_replicas, max_replicas FROM workloads WHERE id = %s", (workload_id,)
        )
    ).fetchone()
    assert row is not None
    check_scale(replicas, int(row[0]), int(row[1]))
    if replicas == workload.replicas:
        return
    await conn.execute(
        b"UPDATE workloads SET replicas = %s, updated_at = now() WHERE id = %s",
        (replicas, workload_id),
    )
    await place(conn, await load_workload(conn, workload_id))


async def pause_workload(conn: Conn, workload_id: str, paused: bool) -> None:
    """Pause (every deployment of it runs 0 replicas, the declaration stays) or resume."""
    row = await (
        await conn.execute(
            b"UPDATE workloads SET paused = %s, updated_at = now() WHERE id = %s "
            b"AND paused <> %s RETURNING id",
            (paused, workload_id, paused),
        )
    ).fetchone()
    if row is None:
        await load_workload(conn, workload_id)  # WorkloadNotFound, or it already was
        return
    # Its deployments keep their shares (and the devices they reserve, so a resume fits);
    # each cluster's desired state now carries `paused`.
    clusters = await (
        await conn.execute(
            b"SELECT DISTINCT cluster_id FROM deployments WHERE workload_id = %s", (workload_id,)
        )
    ).fetchall()
    await conn.execute(
        b"UPDATE deployments SET generation = generation + 1, updated_at = now() "
        b"WHERE workload_id = %s",
        (workload_id,),
    )
    await bump_generations(conn, sorted(str(c[0]) for c in clusters))


async def set_bounds(
    conn: Conn, workload_id: str, low: int | None, high: int | None, replicas: int | None = None
) -> None:
    """New scale bounds; `BadInput` naming the field unless the replicas (the new value, when
    one is given) stay within them."""
    row = await (
        await conn.execute(
            b"SELECT min_replicas, max_replicas, replicas FROM workloads WHERE id = %s",
            (workload_id,),
        )
    ).fetchone()
    if row is None:
        raise WorkloadNotFound(f"no workload {workload_id!r}")
    low = int(row[0]) if low is None else low
    high = int(row[1]) if high is None else high
    check_scale(int(row[2]) if replicas is None else replicas, low, high)
    await conn.execute(
        b"UPDATE workloads SET min_replicas = %s, max_replicas = %s, updated_at = now() "
        b"WHERE id = %s",
        (low, high, workload_id),
    )


async def remove_workload(conn: Conn, workload_id: str) -> list[str]:
    """Delete the workload and its deployments (the clusters undeploy); the clusters touched."""
    await load_workload(conn, workload_id, lock=True)
    touched = await remove_deployments(conn, workload_id)
    await conn.execute(b"DELETE FROM workloads WHERE id = %s", (workload_id,))
    return touched
