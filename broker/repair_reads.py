"""What anti-entropy reads from the Jobs store: keys and seqs, recent removals, records, and
the runs of one origin's rows (what a new run book starts with, `agent.serving.run_book`).

Finished jobs about to be pruned and removals about to expire are left out of what is
compared, on both sides alike (a finished job's age comes from its own `completedAt`), so a
member that pruned a little earlier than another is not handed back what it just pruned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

from broker.anti_entropy import JobKey
from broker.digest_book import BookRow
from broker.jobs import JobsStore
from workload_manager.workload import Workload, WorkloadState

__all__ = [
    "book_rows",
    "compared_keys",
    "compared_removals",
    "data_version",
    "records_for",
    "runs_of",
]

_TERMINAL: Final = tuple(s.value for s in WorkloadState if s.is_terminal)
_decode: Final = msgspec.json.Decoder(Workload).decode
_CHUNK: Final = 100  # keys per SELECT (an OR of 400 costs 13x one of 100: 40 ms vs 3 ms)


async def compared_keys(
    store: JobsStore, *, finished_after_ms: int
) -> list[tuple[str, str, str, int]]:
    """`(originatedFrom, runId, id, seq)` of every job, leaving out jobs that finished
    before `finished_after_ms` (pruning takes them soon)."""
    marks = ",".join("?" * len(_TERMINAL))
    async with store.db.execute(
        "SELECT origin, run_id, id, seq FROM jobs WHERE NOT "
        f"(state IN ({marks}) AND coalesce(completed_at, created_at) < ?)",
        (*_TERMINAL, finished_after_ms),
    ) as cursor:
        return [(str(o), str(r), str(i), int(s)) for o, r, i, s in await cursor.fetchall()]


async def book_rows(store: JobsStore) -> list[BookRow]:
    """Every job's `(originatedFrom, runId, id, seq, state, finished)` -- `finished` is when
    it completed, else when it was created -- for `broker.digest_book.DigestBook.load`."""
    async with store.db.execute(
        "SELECT origin, run_id, id, seq, state, coalesce(completed_at, created_at) FROM jobs"
    ) as cursor:
        return [
            (str(o), str(r), str(i), int(s), str(st), int(f))
            for o, r, i, s, st, f in await cursor.fetchall()
        ]


async def compared_removals(store: JobsStore, *, since: float) -> list[tuple[str, str]]:
    """`(originatedFrom, id)` of the removals recorded here after `since` (epoch s)."""
    async with store.db.execute(
        "SELECT origin, id FROM removed WHERE removed_at >= ?", (since,)
    ) as cursor:
        return [(str(o), str(i)) for o, i in await cursor.fetchall()]


async def records_for(
    store: JobsStore, keys: Sequence[JobKey], *, stored_before: float | None = None
) -> list[Workload]:
    """The records of these jobs that the store holds, as stored; with `stored_before`
    (epoch s), only those it took before then."""
    found: list[Workload] = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        where = " OR ".join("(origin = ? AND run_id = ? AND id = ?)" for _ in chunk)
        args: list[str | float] = [part for key in chunk for part in key]
        if stored_before is not None:
            where = f"({where}) AND stored_at < ?"
            args.append(stored_before)
        async with store.db.execute(f"SELECT record FROM jobs WHERE {where}", args) as cursor:
            found += [_decode(row[0]) for row in await cursor.fetchall()]
    return found


async def runs_of(store: JobsStore, origin: str) -> list[str]:
    """The distinct `runId`s of the jobs `origin` originated that the store holds."""
    async with store.db.execute(
        "SELECT DISTINCT run_id FROM jobs WHERE origin = ? ORDER BY run_id", (origin,)
    ) as cursor:
        return [str(row[0]) for row in await cursor.fetchall()]


async def data_version(store: JobsStore) -> int:
    """SQLite's `PRAGMA data_version`: it changes when another connection (another process,
    an operator's shell) commits to the file, so a cached comparison can tell it is stale."""
    async with store.db.execute("PRAGMA data_version") as cursor:
        row = await cursor.fetchone()
    return int(row[0]) if row else 0
