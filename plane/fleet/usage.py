"""Token usage in the plane: each job's row (`job_usage`) merged from a node's sync, and
the rollup of tokens per model and per key (`usage_rollup`, migration 0005) the fleet
summary reads.

A node sends a finished job's usage with the job's final record. The rows are COPYed into
a staging table and inserted with one statement that also adds them to the rollup; only
rows of jobs the node originated (joined with `jobs`, which the same transaction has just
merged) are taken, and a row already held is left as it is, so a replay adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from plane.core.wire import JobUsage
from plane.db.connection import Conn

__all__ = ["REBUILD", "merge_usage", "usage_summary"]

_COLUMNS: Final = (
    "cluster_id, origin, run_id, id, prompt_tokens, completion_tokens, ttft_ms, total_ms"
)
_STAGE: Final = (
    "CREATE TEMP TABLE IF NOT EXISTS staged_usage "
    "(LIKE job_usage INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
)
_MERGE: Final = f"""
WITH added AS (
    INSERT INTO job_usage ({_COLUMNS})
    SELECT {", ".join("s." + c.strip() for c in _COLUMNS.split(","))}
    FROM staged_usage s JOIN jobs j USING (cluster_id, origin, run_id, id)
    ON CONFLICT DO NOTHING
    RETURNING cluster_id, origin, run_id, id, prompt_tokens, completion_tokens
)
INSERT INTO usage_rollup (cluster_id, model, requester, prompt_tokens, completion_tokens, jobs)
SELECT a.cluster_id, j.model, coalesce(j.requester_id, ''), sum(coalesce(a.prompt_tokens, 0)),
       sum(coalesce(a.completion_tokens, 0)), count(*)
FROM added a JOIN jobs j USING (cluster_id, origin, run_id, id)
GROUP BY 1, 2, 3
ON CONFLICT (cluster_id, model, requester) DO UPDATE SET
    prompt_tokens = usage_rollup.prompt_tokens + excluded.prompt_tokens,
    completion_tokens = usage_rollup.completion_tokens + excluded.completion_tokens,
    jobs = usage_rollup.jobs + excluded.jobs
"""
# For `rollups.rebuild_rollups`: the rollup recomputed from the rows.
REBUILD: Final = (
    b"DELETE FROM usage_rollup",
    b"INSERT INTO usage_rollup (cluster_id, model, requester, prompt_tokens, completion_tokens, "
    b"jobs) SELECT u.cluster_id, j.model, coalesce(j.requester_id, ''), "
    b"coalesce(sum(u.prompt_tokens), 0), coalesce(sum(u.completion_tokens), 0), count(*) "
    b"FROM job_usage u JOIN jobs j USING (cluster_id, origin, run_id, id) GROUP BY 1, 2, 3",
)


async def merge_usage(cur: Any, cluster_id: str, origin: str, usage: Sequence[JobUsage]) -> int:
    """COPY one node's usage rows into staging and merge them; returns how many were sent
    (once each per job)."""
    rows = {(u.runId, u.id): u for u in usage}
    await cur.execute(_STAGE)
    async with cur.copy(f"COPY staged_usage ({_COLUMNS}) FROM STDIN".encode()) as copy:
        for u in rows.values():
            await copy.write_row(
                (cluster_id, origin, u.runId, u.id, u.promptTokens, u.completionTokens,
                 u.ttftMs, u.totalMs)
            )  # fmt: skip
    await cur.execute(b"ANALYZE staged_usage")
    await cur.execute(_MERGE.encode())
    return len(rows)


async def usage_summary(conn: Conn, cluster_id: str | None) -> dict[str, Any]:
    """Tokens per model and per key (requesterId; `none` without one), with job counts."""
    only, args = ("WHERE cluster_id = %s", [cluster_id]) if cluster_id else ("", [])
    rows = await (
        await conn.execute(
            "SELECT model, requester, sum(prompt_tokens), sum(completion_tokens), sum(jobs) "
            f"FROM usage_rollup {only} GROUP BY 1, 2",
            args,
        )
    ).fetchall()
    by_model: dict[str, dict[str, int]] = {}
    by_key: dict[str, dict[str, int]] = {}
    for model, requester, prompt, completion, jobs in rows:
        for table, name in ((by_model, model), (by_key, requester or "none")):
            entry = table.setdefault(name, {"promptTokens": 0, "completionTokens": 0, "jobs": 0})
            entry["promptTokens"] += int(prompt)
            entry["completionTokens"] += int(completion)
            entry["jobs"] += int(jobs)
    return {"byModel": by_model, "byKey": by_key}
