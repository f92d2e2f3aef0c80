"""The Jobs list's filtered pages and counts on 100,000 jobs (issue 17).

Subject: the store as it is (no index on model or requester: each cost a quarter of the
store's write rate, bench/jobs_store.py). Baseline: the same file's copy with indexes on
(model, state) and (requester, state), what they would buy the page. Each round runs the
page's queries -- a first page of 50 filtered by model, by requester, by state and model, by
node; the counts per state unfiltered, by model, by requester -- on both; rate = query sets
per second (a ratio below 1: what the page gives up for the write rate).

    python bench/jobs_filters.py [--jobs 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import msgspec
from _interleave import interleave

from broker.jobs import JobsStore
from broker.jobs_query import Filters, count_by_state
from workload_manager.workload import Workload

STATES = ("queued", "running", "completed", "failed", "cancelled")


def records(count: int) -> list[Workload]:
    """`count` jobs over 20 models, 50 requesters, 5 nodes and every state."""
    out = []
    for i in range(count):
        state = STATES[i % 5] if i % 100 else "queued"
        out.append(
            msgspec.convert(
                {
                    "id": str(i),
                    "model": f"model-{i % 20}",
                    "engine": "vllm",
                    "runId": "r",
                    "state": state,
                    "originatedFrom": f"nod_{i % 5}",
                    "createdAt": 1_764 * 10**9 + i,
                    "startedAt": None,
                    "completedAt": None,
                    "error": None,
                    "requesterId": f"key-{i % 50}",
                    "seq": 1,
                    "scheduledOn": f"nod_{(i + 1) % 5}",
                },
                Workload,
            )
        )
    return out


async def fill(path: Path, count: int) -> None:
    store = await JobsStore.open(path)
    rows = records(count)
    for start in range(0, count, 5000):
        await store.write(rows[start : start + 5000], [], now=time.time())
    await store.close()


async def queries(path: Path) -> float:
    store = await JobsStore.open(path)
    if "base" in path.name:  # opening drops the indexes: make them for the baseline
        await store.db.execute("CREATE INDEX jobs_model ON jobs (model, state)")
        await store.db.execute("CREATE INDEX jobs_requester ON jobs (requester, state)")
    begun = time.perf_counter()
    await store.jobs_page(model="model-7", limit=50)
    await store.jobs_page(requester="key-13", limit=50)
    await store.jobs_page(state="queued", model="model-0", limit=50)
    await store.jobs_page(node="nod_3", limit=50)
    await count_by_state(store.db, Filters())
    await count_by_state(store.db, Filters(model="model-7"))
    await count_by_state(store.db, Filters(requester="key-13"))
    elapsed = time.perf_counter() - begun
    await store.close()
    return 1 / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subject, base = Path(tmp) / "subject.db", Path(tmp) / "base.db"
        asyncio.run(fill(subject, args.jobs))
        with sqlite3.connect(subject) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        shutil.copy(subject, base)
        interleave(
            lambda: asyncio.run(queries(base)),
            lambda: asyncio.run(queries(subject)),
            rounds=args.rounds,
            unit="query sets/s",
            label=f"{args.jobs:,} jobs",
        )


if __name__ == "__main__":
    main()
