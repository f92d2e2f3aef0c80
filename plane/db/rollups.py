"""Rebuilding the job rollups from the jobs table (the sync keeps them exact; this is for
data loaded around it, such as a bulk import or the fleet benchmark)."""

from __future__ import annotations

from typing import Any, Final

from psycopg import AsyncConnection

from plane.fleet import usage

__all__ = ["rebuild_rollups"]

REBUILD: Final = (
    b"DELETE FROM job_rollup",
    b"DELETE FROM job_timing",
    b"INSERT INTO job_rollup (cluster_id, state, model, jobs) "
    b"SELECT cluster_id, state, model, count(*) FROM jobs GROUP BY 1, 2, 3",
    b"INSERT INTO job_timing (cluster_id, hour, kind, bucket, jobs) "
    b"SELECT cluster_id, created_at / 3600000, 'q', "
    b"floor(ln(1 + greatest(started_at - created_at, 0)) / ln(1.1))::int, count(*) "
    b"FROM jobs WHERE started_at IS NOT NULL GROUP BY 1, 2, 3, 4",
    b"INSERT INTO job_timing (cluster_id, hour, kind, bucket, jobs) "
    b"SELECT cluster_id, created_at / 3600000, 'r', "
    b"floor(ln(1 + greatest(completed_at - started_at, 0)) / ln(1.1))::int, count(*) "
    b"FROM jobs WHERE started_at IS NOT NULL AND completed_at IS NOT NULL GROUP BY 1, 2, 3, 4",
)


async def rebuild_rollups(conn: AsyncConnection[tuple[Any, ...]]) -> None:
    """Recompute `job_rollup` and `job_timing` from `jobs`, and `usage_rollup` from
    `job_usage`, in one transaction."""
    async with conn.transaction():
        for statement in (*REBUILD, *usage.REBUILD):
            await conn.execute(statement)
