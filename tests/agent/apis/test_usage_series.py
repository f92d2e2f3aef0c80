"""`/v1/usage/series` from a real `usage.db`: rows land in the bucket of their completion,
older ones are left out, the busiest models and keys are kept (the rest summed as other),
percentiles by nearest rank, an empty window answers zeros and nulls."""

from __future__ import annotations

from pathlib import Path

from agent.apis.usage_series import BUCKETS, MAX_SERIES, OTHER, usage_series
from agent.serving.usage_store import UsageRow, UsageStore

NOW = 1_764_000_000_000


def row(n: int, *, model: str = "m", key: str | None = "k", ago_ms: int = 0) -> UsageRow:
    return UsageRow(
        run_id="r", id=str(n), model=model, requester=key, prompt_tokens=10,
        completion_tokens=n, ttft_ms=n, total_ms=10 * n, completed_at=NOW - ago_ms,
    )  # fmt: skip


async def test_buckets_series_and_percentiles(tmp_path: Path) -> None:
    store = await UsageStore.open(tmp_path / "usage.db")
    try:
        rows = [row(n, ago_ms=1000) for n in range(1, 101)]  # the last minute's bucket
        rows.append(row(101, model="early", key=None, ago_ms=3_599_000))  # the first
        rows.append(row(102, model="gone", ago_ms=3_601_000))  # before the window
        rows += [row(200 + n, model=f"rare-{n}", key=f"k{n}") for n in range(MAX_SERIES)]
        for r in rows:
            store.add(r)
        await store.flush()
        series = await usage_series(store, 3600, now_ms=NOW)
    finally:
        await store.close()
    assert (series["windowS"], series["bucketS"]) == (3600, 60)
    m = series["models"]["m"]
    assert len(m["requests"]) == BUCKETS
    assert (m["requests"][-1], sum(m["requests"]), m["promptTokens"][-1]) == (100, 100, 1000)
    assert m["completionTokens"][-1] == sum(range(1, 101))
    assert series["models"]["early"]["requests"][0] == 1
    assert "gone" not in series["models"]
    # 22 models: the 20 busiest kept by name, the other two summed.
    assert len(series["models"]) == MAX_SERIES + 1
    assert sum(series["models"][OTHER]["requests"]) == 2
    assert sum(series["keys"]["k"]["requests"]) == 100
    assert sum(series["keys"]["(none)"]["requests"]) == 1
    # ttft 1..101 and 200..219 (121 values): nearest rank, the ceil(121 p)-th.
    assert series["ttftMs"] == {"p50": 61, "p95": 213, "p99": 218}
    assert series["latencyMs"]["p50"] == 610


async def test_an_empty_window(tmp_path: Path) -> None:
    store = await UsageStore.open(tmp_path / "usage.db")
    try:
        series = await usage_series(store, 86400, now_ms=NOW)
    finally:
        await store.close()
    assert (series["models"], series["keys"]) == ({}, {})
    assert series["ttftMs"] == {"p50": None, "p95": None, "p99": None}
