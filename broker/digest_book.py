"""The anti-entropy digest of a Jobs store, kept as the store commits instead of read again.

`broker.anti_entropy.digest()` over every job costs O(jobs) -- a SELECT of every key, a hash
of each -- and a store that takes writes changes between any two rounds, so each round paid
it again: at 60,000 jobs a member under load spent an eighth of its event loop on it, and a
week's retention at a steady load holds millions. `DigestBook` holds the same per-bucket
counts and sums, and each job's seq, and moves them by what each commit wrote:

- `written(rows, other)` is the store's commit hook (`JobsStore.on_written`): what the
  digest reads of the rows it upserted is kept (one list extend on the hot path) and
  applied, in one loop, when a digest is next asked for. A row older than the one held
  changes nothing, as in the store's own upsert. A commit that did anything else -- a
  removal, a prune -- and more than `MAX_PENDING` rows waiting make the book stale;
- `load(rows, removed)` builds it from the store (every job, with its state and the time it
  finished): at start, when stale, when another connection wrote the file (SQLite's
  `data_version`), and every `REBUILD_S` at least, which also moves the window of removals
  compared;
- `digest(finished_after_ms)` leaves out, as `repair_reads.compared_keys` does, jobs that
  finished before that time: a heap of finished jobs ages them out as the time passes, so
  two members compare the same set however long ago either rebuilt.

Equal stores give the digest `digest()` gives, key for key (tests/broker/test_digest_book.py
holds it to that after random writes, removals and ageing).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any, Final

from broker.anti_entropy import BUCKETS, Digest, JobKey, digest, job_hash, job_leaf
from workload_manager.workload import WorkloadState

__all__ = ["MAX_PENDING", "REBUILD_S", "BookRow", "DigestBook"]

MAX_PENDING: Final = 100_000  # rows waiting for the next digest (~12 MB); past it, a reload
REBUILD_S: Final = 600.0
_MASK: Final = (1 << 63) - 1
_TERMINAL: Final = frozenset(s.value for s in WorkloadState if s.is_terminal)

# (originatedFrom, runId, id, seq, state, coalesce(completedAt, createdAt))
BookRow = tuple[str, str, str, int, str, int]


class DigestBook:
    """Per-bucket counts and sums of a store's compared jobs, and each job's seq."""

    def __init__(self) -> None:
        self.stale = True  # load() before the next digest
        self.loaded_at = 0.0
        self._jobs: dict[JobKey, tuple[int, int, int]] = {}  # key -> (key hash, seq, leaf)
        self._in_bucket: list[dict[JobKey, int]] = [{} for _ in range(BUCKETS)]
        self._counts = [0] * BUCKETS
        self._sums = [0] * BUCKETS
        self._finished: list[tuple[int, JobKey, int]] = []  # heap: (finished at, key, seq)
        self._aged: dict[JobKey, int] = {}  # left out (finished long ago), with their seq
        self._pending: list[BookRow] = []
        self._removed: list[tuple[str, str]] = []
        self._removed_digest = Digest()
        self._digest: Digest | None = None  # until the next change

    # -- what the store tells ------------------------------------------------------------

    def written(self, rows: Sequence[Sequence[Any]], other: bool) -> None:
        """A commit: the job rows it upserted (`broker.jobs` rows: origin, run, id, seq,
        state, ..., created, completed at 8 and 9); `other`, whether it changed anything
        else (a removal, a prune)."""
        if self.stale:
            return
        if other or len(self._pending) + len(rows) > MAX_PENDING:
            self.stale = True
            self._pending = []
            return
        # Only what the digest reads (not the record's JSON, which the row holds too).
        self._pending.extend(
            (r[0], r[1], r[2], r[3], r[4], r[9] if r[9] is not None else r[8]) for r in rows
        )

    def begin_load(self) -> None:
        """A load starts: what commits from now on is applied after it (some twice, which
        changes nothing)."""
        self.stale = False
        self._pending = []

    def load(self, rows: Iterable[BookRow], removed: list[tuple[str, str]], now: float) -> None:
        """Every job of the store, and the removals compared; then what was committed since
        `begin_load()`."""
        self._jobs = {}
        self._in_bucket = [{} for _ in range(BUCKETS)]
        self._counts = [0] * BUCKETS
        self._sums = [0] * BUCKETS
        self._finished = []
        self._aged = {}
        self._digest = None
        for row in rows:
            self._apply(*row)
        self._removed = removed
        self._removed_digest = digest((), removed)
        self.loaded_at = now

    # -- what anti-entropy reads ---------------------------------------------------------

    def digest(self, finished_after_ms: int) -> Digest:
        """The digest of the compared jobs and removals (`broker.anti_entropy.digest`)."""
        pending, self._pending = self._pending, []
        apply = self._apply
        for row in pending:
            apply(*row)
        self._age(finished_after_ms)
        if self._digest is None:
            counts, sums = self._counts, self._sums
            jobs = [(b, counts[b], sums[b]) for b in range(BUCKETS) if counts[b]]
            self._digest = Digest(jobs=jobs, removed=self._removed_digest.removed)
        return self._digest

    @property
    def removed(self) -> list[tuple[str, str]]:
        """The removals compared, as of the last load."""
        return self._removed

    def keys_in(self, buckets: Iterable[int]) -> dict[JobKey, int]:
        """The compared keys and seqs in these buckets."""
        found: dict[JobKey, int] = {}
        for bucket in buckets:
            found.update(self._in_bucket[bucket])
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    # -- the arithmetic ------------------------------------------------------------------

    def _apply(self, origin: str, run: str, wid: str, seq: int, state: str, finished: int) -> None:
        key = (origin, run, wid)
        held = self._jobs.get(key)
        if held is None:
            aged = self._aged.get(key)
            if aged is not None:
                if aged >= seq:
                    return  # the store keeps its newer row, left out as it is
                del self._aged[key]
            hashed = job_hash(origin, run, wid)
            bucket = hashed % BUCKETS
            self._counts[bucket] += 1
            old = 0
        else:
            hashed, held_seq, old = held
            if held_seq >= seq:
                return
            bucket = hashed % BUCKETS
        leaf = job_leaf(hashed, seq)
        self._sums[bucket] = (self._sums[bucket] - old + leaf) & _MASK
        self._jobs[key] = (hashed, seq, leaf)
        self._in_bucket[bucket][key] = seq
        if state in _TERMINAL:
            heapq.heappush(self._finished, (finished, key, seq))
        self._digest = None

    def _age(self, finished_after_ms: int) -> None:
        # Finished jobs whose time passed out of the comparison leave it, as the SELECT would.
        finished = self._finished
        while finished and finished[0][0] < finished_after_ms:
            _, key, seq = heapq.heappop(finished)
            held = self._jobs.get(key)
            if held is None or held[1] != seq:
                continue  # a newer record of it came since
            hashed, _, leaf = held
            bucket = hashed % BUCKETS
            self._counts[bucket] -= 1
            self._sums[bucket] = (self._sums[bucket] - leaf) & _MASK
            del self._jobs[key]
            del self._in_bucket[bucket][key]
            self._aged[key] = seq
            self._digest = None
