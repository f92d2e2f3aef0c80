"""Changes to a workload's scale that placement carries out: a scale operation, a pause, new
bounds (and whether its count follows its load: then the plane places its max)."""

from __future__ import annotations

from plane.core.errors import BadInput
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
    `BadInput` outside its scale bounds or when its count follows its load (its clusters
    scale it), `Conflict` past a quota (naming it)."""
    workload = await load_workload(conn, workload_id, lock=True)
    row = await (
        await conn.execute(
            b"SELECT min_replicas, max_replicas, on_load FROM workloads WHERE id = %s",
            (workload_id,),
        )
    ).fetchone()
    assert row is not None
    if row[2]:
        raise BadInput(
            f"replicas: {workload.name} follows its load (its clusters scale it between "
            f"minReplicas and maxReplicas, {row[0]}..{row[1]}): change those instead"
        )
    check_scale(replicas, int(row[0]), int(row[1]))
    await _place_at(conn, workload_id, replicas)


async def _place_at(conn: Conn, workload_id: str, replicas: int) -> None:
    """Set the workload's replicas and re-place the delta (the placement lock held)."""
    workload = await load_workload(conn, workload_id)
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
    await _retell(conn, workload_id)


async def _retell(conn: Conn, workload_id: str) -> None:
    """What the workload's clusters are told of it changed, its shares not: they fetch it."""
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
    conn: Conn,
    workload_id: str,
    low: int | None,
    high: int | None,
    replicas: int | None = None,
    *,
    on_load: bool | None = None,
) -> None:
    """New scale bounds, and whether the count follows the load (`on_load`, None: as it
    was); `BadInput` naming the field unless the replicas (the new value, when one is given)
    stay within them. A workload on load is placed at its max (only the delta moves), and
    its clusters are told their new share of min."""
    row = await (
        await conn.execute(
            b"SELECT min_replicas, max_replicas, replicas, on_load FROM workloads WHERE id = %s",
            (workload_id,),
        )
    ).fetchone()
    if row is None:
        raise WorkloadNotFound(f"no workload {workload_id!r}")
    low = int(row[0]) if low is None else low
    high = int(row[1]) if high is None else high
    follows = bool(row[3]) if on_load is None else on_load
    if follows:
        if replicas is not None:
            raise BadInput(
                "replicas: a workload on load is placed at its maxReplicas and its clusters "
                "scale it: change minReplicas or maxReplicas instead"
            )
        check_scale(high, low, high)
        if high == 0:
            raise BadInput("maxReplicas: a workload on load needs a max of 1 or more")
    else:
        check_scale(int(row[2]) if replicas is None else replicas, low, high)
    await conn.execute(
        b"UPDATE workloads SET min_replicas = %s, max_replicas = %s, on_load = %s, "
        b"updated_at = now() WHERE id = %s",
        (low, high, follows, workload_id),
    )
    if follows:
        await load_workload(conn, workload_id, lock=True)
        await _place_at(conn, workload_id, high)
    if (low, follows) != (int(row[0]), bool(row[3])):
        await _retell(conn, workload_id)  # each cluster's part of min, or its bounds, changed


async def remove_workload(conn: Conn, workload_id: str) -> list[str]:
    """Delete the workload and its deployments (the clusters undeploy); the clusters touched."""
    await load_workload(conn, workload_id, lock=True)
    touched = await remove_deployments(conn, workload_id)
    await conn.execute(b"DELETE FROM workloads WHERE id = %s", (workload_id,))
    return touched
