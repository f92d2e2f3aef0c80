"""The runs this node has put its name to: what lets it take back rows of its own that its
Jobs store lost, and only those (docs/security.md, "A node's own jobs").

Only a node speaks for its own jobs, so no member may hand it one -- except a row its store
lost altogether, which it asks back itself (anti-entropy, `agent.cluster.repair`). A member can hold
a row in this node's name that this node never made (a made-up one, or one an older agent
took in), so the node asks back only keys whose `runId` is in this book: the facade's run,
recorded at start before its first job, and every run of an event its owner entered through
`POST /v1/jobs/events` with this node as origin, recorded before that event's 202.

Why a file of its own (`NVPAIR_HOME/runs`, 0600), not a table in `jobs.db`: the case the
exception exists for is `jobs.db` lost -- deleted, corrupt, a disk that dropped its last
commits -- and a table there would be lost with it. One JSON string per line, appended and
fsynced once per new run (never per job); the newest `KEEP` runs are kept (the file is
rewritten to them once it holds twice as many). A line that is not a run id (a write torn by
a crash, a hand edit) is skipped with a warning. When the file does not exist yet (a first
start, an agent older than the book, a book deleted) it is seeded from the runs of this
node's own rows that `jobs.db` holds, so losing one of the two files loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec

from agent.core.errors import AgentError, StartupError
from broker.jobs import JobsStore
from broker.repair_reads import runs_of
from certs import write_atomic

__all__ = ["KEEP", "RunBook", "RunNotRecorded", "open_run_book"]

log = logging.getLogger(__name__)

KEEP: Final = 10_000  # runs remembered: one per agent start, one per run id its owner enters
_MAX_RUN: Final = 256  # a record's runId is 1-256 characters (docs/protocol.md)
_decode: Final = msgspec.json.Decoder(str).decode


class RunNotRecorded(AgentError):
    """A run could not be written to the run book (the disk is full, read-only, failing)."""

    def __init__(self, run_id: str, exc: OSError) -> None:
        why = exc.strerror or type(exc).__name__
        super().__init__(f"this node's run book cannot record run {run_id[:80]!r}: {why}")
        self.run_id = run_id


class RunBook:
    """The run ids this node made or its owner entered in its name, kept in one file."""

    def __init__(
        self,
        path: Path,
        runs: Iterable[str] = (),
        *,
        keep: int = KEEP,
        lines: int = 0,
        torn: bool = False,
    ) -> None:
        self.path = path
        self.keep = keep
        self.existed = lines > 0 or torn  # there was a file with something in it
        self._runs: dict[str, None] = dict.fromkeys(runs)  # oldest first
        self._lines = max(lines, len(self._runs))  # lines in the file, skipped ones too
        self._torn = torn  # the file ends inside a line: the next append starts a new one
        self._lock = threading.Lock()  # `record` runs in worker threads

    @classmethod
    def open(cls, path: Path, *, keep: int = KEEP) -> RunBook:
        """The book in `path` (an empty one when there is no file yet)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(path, keep=keep)
        runs: list[str] = []
        skipped = 0
        for line in data.splitlines():
            run = _run_of(line)
            if run is None:
                skipped += 1
            else:
                runs.append(run)
        if skipped:
            log.warning("%s: skipped %d line(s) that are not a run id", path.name, skipped)
        torn = not data.endswith(b"\n")  # a write a crash cut short (or a hand edit)
        return cls(path, runs, keep=keep, lines=len(runs) + skipped, torn=torn and bool(data))

    def __len__(self) -> int:
        return len(self._runs)

    def holds(self, run_id: str) -> bool:
        """Whether this node recorded `run_id` as one of its own runs."""
        return run_id in self._runs

    def record(self, *run_ids: str) -> None:
        """Record runs, on disk (fsynced) before this returns; ones already held cost nothing.

        Blocking: call it from a worker thread on a running loop (`remember`).
        Raises `RunNotRecorded` when the file cannot be written (nothing is held then).
        """
        with self._lock:
            new = [run for run in dict.fromkeys(run_ids) if run not in self._runs]
            if not new:
                return
            lines = b"".join(msgspec.json.encode(run) + b"\n" for run in new)
            try:
                self._append(b"\n" + lines if self._torn else lines)
            except OSError as exc:
                raise RunNotRecorded(new[0], exc) from exc
            self._torn = False
            self._runs.update(dict.fromkeys(new))
            self._lines += len(new)
            if self._lines > 2 * self.keep:
                self._compact()

    async def remember(self, run_id: str) -> None:
        """`record(run_id)` off the event loop; at once when it is held already."""
        if run_id not in self._runs:
            await asyncio.to_thread(self.record, run_id)

    def _append(self, data: bytes) -> None:
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _sync_dir(self.path.parent)  # the new file's name is durable too

    def _compact(self) -> None:
        # Past twice the bound: keep the newest `keep`. A failure here is not the caller's
        # (what it asked is on disk already): the file stays long and is tried again later.
        runs = list(self._runs)[-self.keep :]
        data = b"".join(msgspec.json.encode(run) + b"\n" for run in runs)
        try:
            write_atomic(self.path, data)
            _sync_dir(self.path.parent)
        except OSError as exc:
            log.warning("could not compact %s: %s", self.path.name, exc.strerror or exc)
            return
        self._runs = dict.fromkeys(runs)
        self._lines = len(runs)


async def open_run_book(path: Path, store: JobsStore, node_id: str, *runs: str) -> RunBook:
    """The run book at `path`, with `runs` (the facade's, before its first job) recorded; a
    new book is seeded with the runs of this node's own rows that `store` holds (a first
    start, an older agent's home, a book that was deleted). `StartupError` when it cannot be
    written: a 202 would promise what a lost store could not get back."""
    book = await asyncio.to_thread(RunBook.open, path)
    seeded = [] if book.existed else await runs_of(store, node_id)
    try:
        await asyncio.to_thread(book.record, *seeded, *runs)
    except RunNotRecorded as exc:
        raise StartupError(str(exc)) from None
    if seeded:
        log.info("started %s with the %d run(s) of this node's rows", path.name, len(seeded))
    return book


def _run_of(line: bytes) -> str | None:
    try:
        run = _decode(line)
    except msgspec.DecodeError:
        return None
    return run if 0 < len(run) <= _MAX_RUN else None


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system can fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
