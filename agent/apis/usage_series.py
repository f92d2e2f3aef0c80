"""`GET /v1/usage/series`: requests and tokens per model and per key over the last hour or
day, in buckets, and the time-to-first-token and latency percentiles -- from this agent's
own `job_usage` rows (the jobs it originated; counts and milliseconds, never text).

Bounded whatever the store holds: `BUCKETS` buckets, the `MAX_SERIES` busiest models and
keys (the rest summed under `"(other)"`), a few indexed aggregate queries.
"""

from __future__ import annotations

from typing import Any, Final

from agent.serving.usage_store import UsageStore

__all__ = ["BUCKETS", "MAX_SERIES", "WINDOWS", "usage_series"]

WINDOWS: Final = (3600, 86400)
BUCKETS: Final = 60  # an hour in minutes, a day in 24-minute buckets
MAX_SERIES: Final = 20
OTHER: Final = "(other)"


async def usage_series(store: UsageStore, window_s: int, *, now_ms: int) -> dict[str, Any]:
    """The answer of `/v1/usage/series?window=window_s` at `now_ms`."""
    bucket_ms = window_s * 1000 // BUCKETS
    since = now_ms - window_s * 1000
    db = store.db
    models: dict[str, dict[str, list[int]]] = {}
    keys: dict[str, dict[str, list[int]]] = {}
    for column, into in (("model", models), ("coalesce(requester, '(none)')", keys)):
        async with db.execute(
            f"SELECT {column}, min(?, (completed_at - ?) / ?), count(*), "
            "coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0) "
            "FROM job_usage WHERE completed_at >= ? GROUP BY 1, 2",
            (BUCKETS - 1, since, bucket_ms, since),
        ) as cursor:
            rows = await cursor.fetchall()
        totals: dict[str, int] = {}
        for name, _, requests, _, _ in rows:
            totals[str(name)] = totals.get(str(name), 0) + int(requests)
        kept = set(sorted(totals, key=lambda n: (-totals[n], n))[:MAX_SERIES])
        for name, bucket, requests, prompt, completion in rows:
            label = str(name) if str(name) in kept else OTHER
            series = into.setdefault(
                label,
                {k: [0] * BUCKETS for k in ("requests", "promptTokens", "completionTokens")},
            )
            series["requests"][int(bucket)] += int(requests)
            series["promptTokens"][int(bucket)] += int(prompt)
            series["completionTokens"][int(bucket)] += int(completion)
    return {
        "windowS": window_s,
        "bucketS": bucket_ms / 1000,
        "since": since,
        "models": models,
        "keys": keys,
        "ttftMs": await _percentiles(store, "ttft_ms", since),
        "latencyMs": await _percentiles(store, "total_ms", since),
    }


async def _percentiles(store: UsageStore, column: str, since: int) -> dict[str, int | None]:
    # Nearest rank, each one row read at its offset: no list of every value in memory.
    where = f"FROM job_usage WHERE completed_at >= ? AND {column} IS NOT NULL"
    async with store.db.execute(f"SELECT count(*) {where}", (since,)) as cursor:
        row = await cursor.fetchone()
    count = int(row[0]) if row else 0
    answer: dict[str, int | None] = {}
    for name, p in (("p50", 50), ("p95", 95), ("p99", 99)):
        if not count:
            answer[name] = None
            continue
        offset = max(0, -(-count * p // 100) - 1)
        async with store.db.execute(
            f"SELECT {column} {where} ORDER BY {column} LIMIT 1 OFFSET ?", (since, offset)
        ) as cursor:
            value = await cursor.fetchone()
        answer[name] = int(value[0]) if value else None
    return answer
