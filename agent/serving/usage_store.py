"""Each job's usage and times, kept on the node that originated it, in `usage.db` beside
the Jobs store (its own file, connection and writer: the seed's 13-field record and the
Jobs store stay exactly as they are).

The facade hands a row in as its job finishes (`add`, no I/O: a bounded buffer); `run()`
writes what is buffered every `FLUSH_S` or as soon as `BATCH` rows wait, in one transaction
per batch, never one per row. Rows hold counts and milliseconds only, never a prompt.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import aiosqlite
import msgspec

from agent.core.errors import AgentError
from plane.core.wire import JobUsage

__all__ = ["BATCH", "FLUSH_S", "MAX_PENDING", "UsageRow", "UsageStore", "UsageUnavailable"]

FLUSH_S: Final = 0.5
BATCH: Final = 500  # rows that wake the writer before its interval
MAX_PENDING: Final = 10_000  # rows buffered at most; past it new rows are dropped (counted)
_LOOKUP: Final = 400  # jobs per lookup statement (two parameters each)
_PRUNE_EVERY_S: Final = 600.0

log = logging.getLogger(__name__)

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS job_usage (
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    model TEXT NOT NULL,
    requester TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    ttft_ms INTEGER,
    total_ms INTEGER,
    completed_at INTEGER NOT NULL,
    PRIMARY KEY (run_id, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS job_usage_completed ON job_usage (completed_at);
"""
_INSERT: Final = (
    "INSERT OR REPLACE INTO job_usage (run_id, id, model, requester, prompt_tokens, "
    "completion_tokens, ttft_ms, total_ms, completed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _make_private(path: Path) -> None:
    # Like jobs.db: 0600 whatever the umask (SQLite gives its -wal and -shm the same mode).
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


class UsageRow(msgspec.Struct, frozen=True, array_like=True):
    """One finished job's usage: tokens the engine reported (None: it reported none), time
    to the first streamed byte (None: not streamed) and the total, in ms."""

    run_id: str
    id: str
    model: str
    requester: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_ms: int | None
    total_ms: int | None
    completed_at: int

    def wire(self) -> JobUsage:
        """The row as the plane takes it (`SyncBatch.usage`)."""
        return JobUsage(
            runId=self.run_id,
            id=self.id,
            promptTokens=self.prompt_tokens,
            completionTokens=self.completion_tokens,
            ttftMs=self.ttft_ms,
            totalMs=self.total_ms,
        )


class UsageUnavailable(AgentError):
    """The usage database refused a write (locked, full, read-only); the batch is kept."""


class UsageStore:
    """The `job_usage` table and its batched writer."""

    def __init__(self, db: aiosqlite.Connection, *, retention_h: float = 24.0) -> None:
        self.db = db
        self.retention_h = retention_h
        self._pending: collections.deque[UsageRow] = collections.deque()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one transaction at a time on the one connection
        self.transactions = 0  # batches committed (a test counts them)
        self.dropped = 0  # rows refused because MAX_PENDING were waiting
        self.problem: str | None = None  # why the last write failed (None: writing)

    @classmethod
    async def open(cls, path: Path, *, retention_h: float = 24.0) -> UsageStore:
        """Open (creating, 0600) the store at `path`, in WAL mode."""
        _make_private(path)
        db = await aiosqlite.connect(path, timeout=1.0)
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.executescript(SCHEMA)
            await db.commit()
        except BaseException:
            await db.close()
            raise
        return cls(db, retention_h=retention_h)

    async def close(self) -> None:
        """Write what is buffered (if the database takes it) and close."""
        with contextlib.suppress(UsageUnavailable):
            await self.flush()
        await self.db.close()

    @property
    def pending(self) -> int:
        """Rows buffered, not yet committed."""
        return len(self._pending)

    def add(self, row: UsageRow) -> None:
        """Buffer one row (no I/O: called on the request path)."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(row)
        if len(self._pending) >= BATCH:
            self._wake.set()

    async def flush(self) -> None:
        """Commit every buffered row in one transaction (`UsageUnavailable`: kept for later)."""
        async with self._lock:
            if not self._pending:
                return
            rows = list(self._pending)
            try:
                await self.db.executemany(_INSERT, [msgspec.structs.astuple(r) for r in rows])
                await self.db.commit()
            except aiosqlite.DatabaseError as exc:  # locked, full, read-only, I/O error
                with contextlib.suppress(aiosqlite.Error):
                    await self.db.rollback()
                raise UsageUnavailable(str(exc)) from exc
            for _ in rows:
                self._pending.popleft()
            self.transactions += 1

    async def run(self) -> None:
        """Flush every `FLUSH_S` (sooner when `BATCH` rows wait) and prune old rows, until
        cancelled."""
        pruned = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), FLUSH_S)
            self._wake.clear()
            try:
                await self.flush()
                if time.monotonic() - pruned > _PRUNE_EVERY_S:
                    pruned = time.monotonic()
                    await self.prune(int(time.time() * 1000 - self.retention_h * 3_600_000))
                self.problem = None
            except UsageUnavailable as exc:
                if self.problem is None:  # once per outage, not every 0.5 s
                    log.warning("usage.db refused a write (%s); rows kept, retrying", exc)
                self.problem = str(exc)[:200]

    async def prune(self, older_than_ms: int) -> None:
        """Delete the rows of jobs that finished before `older_than_ms` (the Jobs store's
        retention: their jobs are pruned there too)."""
        async with self._lock:
            try:
                await self.db.execute(
                    "DELETE FROM job_usage WHERE completed_at < ?", (older_than_ms,)
                )
                await self.db.commit()
            except aiosqlite.DatabaseError as exc:
                with contextlib.suppress(aiosqlite.Error):
                    await self.db.rollback()
                raise UsageUnavailable(str(exc)) from exc

    async def of(self, jobs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], UsageRow]:
        """The rows of these (runId, id) jobs that have one, by (runId, id); buffered rows
        are written first, so a job that finished is there."""
        with contextlib.suppress(UsageUnavailable):
            await self.flush()
        keys = list(dict.fromkeys(jobs))
        found: dict[tuple[str, str], UsageRow] = {}
        for start in range(0, len(keys), _LOOKUP):
            part = keys[start : start + _LOOKUP]
            values = ",".join("(?, ?)" for _ in part)
            args = [v for key in part for v in key]
            async with self.db.execute(
                "SELECT run_id, id, model, requester, prompt_tokens, completion_tokens, ttft_ms, "
                f"total_ms, completed_at FROM job_usage WHERE (run_id, id) IN (VALUES {values})",
                args,
            ) as cursor:
                for row in await cursor.fetchall():
                    usage = UsageRow(*row)
                    found[(usage.run_id, usage.id)] = usage
        return found
