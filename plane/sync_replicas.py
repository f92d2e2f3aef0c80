"""The replicas, allocations and facade address one node reports in its `SyncBatch`."""

from __future__ import annotations

from psycopg import AsyncCursor

from .wire import SyncBatch

__all__ = ["write_replicas"]


async def write_replicas(
    cur: AsyncCursor[tuple[object, ...]], cluster_id: str, node_id: str, batch: SyncBatch
) -> dict[str, int]:
    """Replace this node's replicas and allocations with the batch's (when it carries
    them); counts written by kind."""
    return {}
