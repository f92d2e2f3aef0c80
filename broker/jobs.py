"""The per-node Jobs store: every member's view of every job, durable in SQLite (WAL).

One row per job, keyed by `(originatedFrom, runId, id)`, holding the latest record (a newer
`seq` wins; an older or equal one changes nothing) and the record's exact JSON, so a record
read back re-encodes to what was stored (absent stays absent, null stays null). Removals
delete the job and leave a row in `removed`, so a late upsert cannot bring it back.

Writes are group-committed by `JobsWriter` (`broker/writer.py`, re-exported here). A write
the database refuses -- locked past the short busy timeout, read-only, full, failing -- raises
`StoreUnavailable`, which the writer retries; anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import aiosqlite
import msgspec

from broker.errors import InvalidCursor, StoreUnavailable
from broker.jobs_query import Filters, open_filters
from broker.jobs_query import where as filters_where
from broker.writer import JobsWriter
from netkit.tasks import describe
from workload_manager.manager import View
from workload_manager.workload import Workload, WorkloadRemoval, WorkloadState

__all__ = ["BUSY_TIMEOUT_S", "MAX_PAGE", "JobsStore", "JobsWriter"]

# A locked database fails fast, so the writer retries (with backoff) instead of stalling.
BUSY_TIMEOUT_S: Final = 1.0

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS jobs (
    origin TEXT NOT NULL,
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    model TEXT NOT NULL,
    engine TEXT NOT NULL,
    scheduled_on TEXT,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    record BLOB NOT NULL,
    PRIMARY KEY (origin, run_id, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_scheduled_on ON jobs (scheduled_on);
-- A removal deletes by (origin, id) across every run: without this it scans the origin.
CREATE INDEX IF NOT EXISTS jobs_origin_id ON jobs (origin, id);
-- The Jobs list's order (newest first) and its cursor: a page reads its rows, not every row
-- sorted (paging through 100,000 jobs: 0.2 s instead of 5 s, for ~8 % on the write).
CREATE INDEX IF NOT EXISTS jobs_newest ON jobs (created_at, id, origin, run_id);
CREATE TABLE IF NOT EXISTS removed (
    origin TEXT NOT NULL,
    id TEXT NOT NULL,
    removed_at REAL NOT NULL,
    PRIMARY KEY (origin, id)
) WITHOUT ROWID;
"""

# A newer seq wins; an older or equal one leaves the row as it is. (A removed job is kept
# out before the statement runs: a NOT EXISTS subquery here halves the insert rate.)
_UPSERT: Final = """
INSERT INTO jobs (origin, run_id, id, seq, state, model, engine, scheduled_on,
                  created_at, completed_at, record, requester, stored_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (origin, run_id, id) DO UPDATE SET
    seq = excluded.seq, state = excluded.state, model = excluded.model,
    engine = excluded.engine, scheduled_on = excluded.scheduled_on,
    created_at = excluded.created_at, completed_at = excluded.completed_at,
    record = excluded.record, requester = excluded.requester, stored_at = excluded.stored_at
WHERE excluded.seq > jobs.seq
"""

_TERMINAL: Final = tuple(s.value for s in WorkloadState if s.is_terminal)

_encode: Final = msgspec.json.Encoder().encode
_decode: Final = msgspec.json.Decoder(Workload).decode
_cursor: Final = msgspec.json.Decoder(tuple[str, str, str])
_page: Final = msgspec.json.Decoder(tuple[int, str, str, str])
MAX_PAGE: Final = 10_000  # rows in one page of the Jobs list


def _page_cursor(cursor: str) -> tuple[int, str, str, str]:
    # A `jobs_page` cursor: (created_at, id, origin, run_id) of a page's last row.
    try:
        return _page.decode(base64.urlsafe_b64decode(cursor.encode("ascii")))
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        raise InvalidCursor(cursor[:100]) from None


def _row(record: Workload) -> tuple[Any, ...]:
    completed = record.completedAt if isinstance(record.completedAt, int) else None
    scheduled = record.scheduledOn if isinstance(record.scheduledOn, str) else None
    return (
        record.originatedFrom,
        record.runId,
        record.id,
        record.seq,
        record.state.value,
        record.model,
        record.engine,
        scheduled,
        record.createdAt,
        completed,
        _encode(record),
        record.requesterId if isinstance(record.requesterId, str) else None,
    )


def _refusal(exc: sqlite3.Error) -> str:
    # SQLite's message with its extended code: on a disk turned read-only under the agent
    # the message is only "disk I/O error", and SQLITE_IOERR_WRITE says it is the writes.
    name = getattr(exc, "sqlite_errorname", None)
    return f"{describe(exc)} ({name})" if name else describe(exc)


def _make_private(path: Path) -> None:
    # jobs.db holds every job's metadata: 0600 whatever the umask (SQLite would create it
    # 0644 less the umask). SQLite gives the -wal and -shm it creates the database file's
    # mode; ones left by an older run are narrowed too.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(file, 0o600)


class JobsStore:
    """Reads and batched writes over one SQLite file."""

    def __init__(self, db: aiosqlite.Connection, removed: set[tuple[str, str]]) -> None:
        self.db = db
        # (originatedFrom, id) of removed jobs, as in the `removed` table (pruned with it).
        self._removed = removed
        # One connection: two coroutines' transactions must not interleave on it (the
        # writer's batch and a prune would otherwise share one BEGIN ... COMMIT).
        self._one_transaction = asyncio.Lock()
        # Every committed record's JSON, local and relayed, in commit order (the page's feed).
        self.on_commit: Callable[[list[bytes]], None] = lambda records: None
        # Every commit: the job rows it upserted, and whether it changed anything else (a
        # removal, a prune) -- the anti-entropy digest follows it (`broker.digest_book`).
        self.on_written: Callable[[list[tuple[Any, ...]], bool], None] = lambda rows, other: None

    @classmethod
    async def open(cls, path: Path) -> JobsStore:
        """Open (creating if needed) the store at `path`, in WAL mode."""
        path.parent.mkdir(parents=True, exist_ok=True)
        _make_private(path)
        db = await aiosqlite.connect(path, timeout=BUSY_TIMEOUT_S)
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint; WAL-safe
            await db.executescript(SCHEMA)
            async with db.execute("PRAGMA table_info(jobs)") as cursor:
                columns = {row[1] for row in await cursor.fetchall()}
            if "plane_seq" not in columns:
                # The seq of each job the plane has acknowledged: the durable sync outbox.
                await db.execute("ALTER TABLE jobs ADD COLUMN plane_seq INTEGER NOT NULL DEFAULT 0")
            if "stored_at" not in columns:
                # When this store last took a newer record of the job (epoch s): anti-entropy
                # hands on only what settled here, not what the relay is still delivering.
                await db.execute("ALTER TABLE jobs ADD COLUMN stored_at REAL NOT NULL DEFAULT 0")
            await open_filters(db)  # the Jobs list's model and requester filters
            await db.commit()
            async with db.execute("SELECT origin, id FROM removed") as rows:
                removed = {(str(origin), str(wid)) for origin, wid in await rows.fetchall()}
        except BaseException:
            await db.close()
            raise
        return cls(db, removed)

    async def close(self) -> None:
        """Close the database."""
        await self.db.close()

    async def write(
        self,
        upserts: Iterable[Workload],
        removals: Iterable[WorkloadRemoval],
        *,
        now: float,
        relayed: Sequence[Workload] = (),
    ) -> int:
        """Apply a batch in one transaction: removals first, then upserts, then the records
        the relay delivered (`relayed`); returns how many of those the store already held at
        that seq or a later one (a removed job's are not counted: they are kept out).

        Raises `StoreUnavailable` when the database refuses the write; nothing of the batch
        is applied then, and the same batch may be written again.
        """
        removal_rows = [(r.originatedFrom, r.workloadId, now) for r in removals]
        gone = self._removed
        if removal_rows:  # a copy, kept only once committed: a refused batch leaves no trace
            gone = gone | {(origin, wid) for origin, wid, _ in removal_rows}
        upsert_rows = [(*_row(r), now) for r in upserts if (r.originatedFrom, r.id) not in gone]
        relayed_rows = [(*_row(r), now) for r in relayed if (r.originatedFrom, r.id) not in gone]
        redundant = 0
        async with self._refused_as_unavailable(), self._transaction():
            if removal_rows:
                await self.db.executemany(
                    "INSERT OR IGNORE INTO removed (origin, id, removed_at) VALUES (?, ?, ?)",
                    removal_rows,
                )
                await self.db.executemany(
                    "DELETE FROM jobs WHERE origin = ? AND id = ?",
                    [(origin, wid) for origin, wid, _ in removal_rows],
                )
            if upsert_rows:
                await self.db.executemany(_UPSERT, upsert_rows)
            if relayed_rows:
                # rowcount sums the rows each statement inserted or updated: an older or
                # equal seq changes none.
                cursor = await self.db.executemany(_UPSERT, relayed_rows)
                redundant = len(relayed_rows) - cursor.rowcount
        self._removed = gone
        self.on_written(upsert_rows + relayed_rows, bool(removal_rows))
        self.on_commit([row[10] for row in (*upsert_rows, *relayed_rows)])
        return redundant

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[None]:
        async with self._one_transaction:
            await self.db.execute("BEGIN")
            try:
                yield
                await self.db.commit()  # inside: a commit that fails (disk full) rolls back
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    await self.db.rollback()
                raise

    @staticmethod
    @contextlib.asynccontextmanager
    async def _refused_as_unavailable() -> AsyncIterator[None]:
        # The database's refusals (locked, read-only, full, I/O error, not a database):
        # the store is unavailable, and the same write may succeed later. Constraint and
        # programming errors are bugs and pass through.
        try:
            yield
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(_refusal(exc)) from exc
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise StoreUnavailable(_refusal(exc)) from exc

    async def jobs(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 1000,
    ) -> list[Workload]:
        """Jobs, newest first, filtered by state and by the node they run or ran on."""
        jobs, _ = await self.jobs_page(state=state, node=node, limit=limit)
        return jobs

    async def jobs_page(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 1000,
        after: str | None = None,
        model: str | None = None,
        requester: str | None = None,
    ) -> tuple[list[Workload], str | None]:
        """A page of `jobs()` and the cursor of the next (None after the last page).

        `after` is a page's cursor; one this store did not give out is `InvalidCursor`. The
        order is total (newest first, then id, origin, run), so paging visits every job once
        even while jobs are added (those newer than the first page are not visited).
        """
        clauses, args = filters_where(
            Filters(state=state, node=node, model=model, requester=requester)
        )
        if after is not None:
            clauses.append("(created_at, id, origin, run_id) < (?, ?, ?, ?)")
            args += list(_page_cursor(after))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        limit = max(1, min(limit, MAX_PAGE))
        query = (
            f"SELECT created_at, id, origin, run_id, record FROM jobs {where} "
            "ORDER BY created_at DESC, id DESC, origin DESC, run_id DESC LIMIT ?"
        )
        async with self.db.execute(query, (*args, limit)) as cursor:
            rows = list(await cursor.fetchall())
        more = None
        if len(rows) == limit:
            more = base64.urlsafe_b64encode(_encode(list(rows[-1][:4]))).decode()
        return [_decode(row[4]) for row in rows], more

    async def origins_of(self, workload_id: str) -> list[str]:
        """The nodes that originated a job with this id (ids are unique per origin only)."""
        async with self.db.execute(
            "SELECT DISTINCT origin FROM jobs WHERE id = ? ORDER BY origin", (workload_id,)
        ) as cursor:
            return [str(row[0]) for row in await cursor.fetchall()]

    def is_removed(self, origin: str, workload_id: str) -> bool:
        """Whether a removal of this job is committed (and its tombstone not yet pruned)."""
        return (origin, workload_id) in self._removed

    async def running_by_node(self, *, exclude_origin: str) -> dict[str, int]:
        """Placed jobs (queued or running, with a `scheduledOn`) per node, leaving out one
        origin's; a job in a facade's wait line has no target yet and holds no capacity."""
        async with self.db.execute(
            "SELECT scheduled_on, count(*) FROM jobs WHERE state IN ('queued', 'running') "
            "AND scheduled_on IS NOT NULL AND origin != ? GROUP BY 1",
            (exclude_origin,),
        ) as cursor:
            return {str(node): int(count) for node, count in await cursor.fetchall()}

    async def active_on(self, node: str) -> list[str]:
        """Ids (`origin/runId/id`) of the queued and running jobs placed on `node`."""
        async with self.db.execute(
            "SELECT origin, run_id, id FROM jobs WHERE state IN ('queued', 'running') "
            "AND scheduled_on = ? ORDER BY created_at",
            (node,),
        ) as cursor:
            return [f"{o[-6:]}/{r[-6:]}/{i}" for o, r, i in await cursor.fetchall()]

    async def unsynced(self, origin: str, limit: int) -> list[Workload]:
        """Jobs this node originated whose latest seq the plane has not acknowledged."""
        async with self.db.execute(
            "SELECT record FROM jobs WHERE origin = ? AND plane_seq < seq "
            "ORDER BY created_at LIMIT ?",
            (origin, limit),
        ) as cursor:
            return [_decode(row[0]) for row in await cursor.fetchall()]

    async def mark_synced(self, records: Iterable[Workload]) -> None:
        """The plane acknowledged these records (at these seqs) in one transaction."""
        rows = [(r.seq, r.originatedFrom, r.runId, r.id, r.seq) for r in records]
        async with self._refused_as_unavailable(), self._transaction():
            await self.db.executemany(
                "UPDATE jobs SET plane_seq = ? WHERE origin = ? AND run_id = ? AND id = ? "
                "AND plane_seq < ?",
                rows,
            )

    async def count_by_state(self) -> dict[str, int]:
        """How many jobs are in each state."""
        async with self.db.execute("SELECT state, count(*) FROM jobs GROUP BY state") as cursor:
            return {str(state): int(count) for state, count in await cursor.fetchall()}

    async def view(self, *, cursor: str | None = None, limit: int = 2000) -> View:
        """A page of every job record, plus (on the first page) every removal.

        `cursor` is a page's `next`; one this store did not give out is `InvalidCursor`.
        """
        try:
            after = _cursor.decode(cursor) if cursor else ("", "", "")
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise InvalidCursor(cursor or "") from None
        async with self.db.execute(
            "SELECT origin, run_id, id, record FROM jobs WHERE (origin, run_id, id) > (?, ?, ?) "
            "ORDER BY origin, run_id, id LIMIT ?",
            (*after, limit),
        ) as rows:
            page = list(await rows.fetchall())
        removed: list[WorkloadRemoval] = []
        if cursor is None:
            async with self.db.execute("SELECT origin, id FROM removed") as rows:
                removed = [
                    WorkloadRemoval(workloadId=wid, originatedFrom=origin)
                    for origin, wid in await rows.fetchall()
                ]
        next_cursor = (
            msgspec.json.encode(list(page[-1][:3])).decode() if len(page) == limit else None
        )
        return View(workloads=[_decode(row[3]) for row in page], removed=removed, next=next_cursor)

    async def prune(self, *, older_than_ms: int, removed_before: float) -> int:
        """Delete finished jobs completed before `older_than_ms` and old tombstones."""
        async with self._refused_as_unavailable(), self._transaction():
            marks = ",".join("?" * len(_TERMINAL))
            cursor = await self.db.execute(
                f"DELETE FROM jobs WHERE state IN ({marks}) "
                "AND coalesce(completed_at, created_at) < ?",
                (*_TERMINAL, older_than_ms),
            )
            pruned = cursor.rowcount
            cursor = await self.db.execute(
                "DELETE FROM removed WHERE removed_at < ?", (removed_before,)
            )
            expired = cursor.rowcount
            async with self.db.execute("SELECT origin, id FROM removed") as rows:
                self._removed = {(str(o), str(w)) for o, w in await rows.fetchall()}
        if pruned or expired:
            self.on_written([], True)
        return pruned
