"""Changes to a workload's scale that placement carries out: a scale operation, a pause."""

from __future__ import annotations

from ._db import Conn

__all__ = ["pause_workload", "scale_workload"]


async def scale_workload(conn: Conn, workload_id: str, replicas: int) -> None:
    """Set the workload's replicas and re-place only the delta, in the caller's transaction;
    `BadInput` outside its scale bounds, `Conflict` past a quota (naming it)."""
    raise NotImplementedError("built by the placement work of issue 16")


async def pause_workload(conn: Conn, workload_id: str, paused: bool) -> None:
    """Pause (every deployment of it runs 0 replicas, the declaration stays) or resume."""
    raise NotImplementedError("built by the placement work of issue 16")
