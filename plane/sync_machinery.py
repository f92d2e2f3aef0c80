"""The events, components, cache residency and operation phases one node reports in its
`SyncBatch`."""

from __future__ import annotations

from psycopg import AsyncCursor

from .wire import SyncBatch

__all__ = ["write_machinery"]


async def write_machinery(
    cur: AsyncCursor[tuple[object, ...]], cluster_id: str, node_id: str, batch: SyncBatch
) -> dict[str, int]:
    """Write what the batch carries of the machinery side; counts written by kind."""
    return {}
