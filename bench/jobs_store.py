"""Jobs-store upserts through the group-committing writer (issue 5).

Subject: `JobsWriter.upsert()` for N records, then `flush()` -- aiosqlite, WAL, the real
schema with its newer-seq-wins and removed-job checks, 1,000 rows per transaction.
Baseline: raw `sqlite3`, the same rows, `executemany` of a plain INSERT, 1,000 rows per
transaction, WAL, same pragmas. Paired rounds on fresh files; ratio = subject / baseline.

    python bench/jobs_store.py [--rows 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from _interleave import interleave

from broker.jobs import SCHEMA, JobsStore, JobsWriter, _row
from workload_manager.workload import Workload, decode_workload


def records(count: int, run: str) -> list[Workload]:
    """`count` realistic running records."""
    return [
        decode_workload(
            json.dumps(
                {
                    "id": str(i),
                    "model": "meta-llama/Llama-3.1-8B-Instruct",
                    "engine": "vllm",
                    "runId": run,
                    "state": "running",
                    "originatedFrom": "nod_01jd8x3c5v0q2k9m4t7w1y6z8a",
                    "scheduledOn": "nod_01jd8x3c5v0q2k9m4t7w1y6z8b",
                    "createdAt": 1_764_000_000_000 + i,
                    "startedAt": 1_764_000_000_500 + i,
                    "completedAt": None,
                    "error": None,
                    "requesterId": "team-search",
                    "seq": 2,
                }
            )
        )
        for i in range(count)
    ]


def raw_sqlite(path: Path, rows: list[tuple[object, ...]]) -> float:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(SCHEMA)
    insert = "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    start = time.perf_counter()
    for i in range(0, len(rows), 1000):
        db.execute("BEGIN")
        db.executemany(insert, rows[i : i + 1000])
        db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    return len(rows) / elapsed


async def store_writer(path: Path, batch: list[Workload]) -> float:
    store = await JobsStore.open(path)
    try:
        async with JobsWriter(store, max_batch=1000) as writer:
            start = time.perf_counter()
            for record in batch:
                writer.upsert(record)
            await writer.flush()
            elapsed = time.perf_counter() - start
    finally:
        await store.close()
    return len(batch) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    counter = iter(range(1_000_000))
    with tempfile.TemporaryDirectory() as tmp:

        def fresh() -> Path:
            return Path(tmp) / f"jobs-{next(counter)}.db"

        batch = records(args.rows, "bench")
        # The baseline gets its rows ready-made (the schema's columns, not those added later).
        rows = [_row(record)[:11] for record in batch]
        interleave(
            lambda: raw_sqlite(fresh(), rows),
            lambda: asyncio.run(store_writer(fresh(), batch)),
            rounds=args.rounds,
            unit="rows/s",
            label="jobs store upserts:",
        )


if __name__ == "__main__":
    main()
