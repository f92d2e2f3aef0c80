"""Anti-entropy between two members' Jobs stores, sans-I/O: find what differs, cheaply.

Catch-up on (re)connect covers a member that was away; anything else that makes two views
differ -- a frame dropped on the way, a row lost from a store, a peer's events lost for a
while -- would stay. So members compare their stores periodically, as Serf's push-pull and
Cassandra's Merkle repair do, and exchange only what differs:

1. The initiator sends a `Digest`: for each of `BUCKETS` buckets (a job's bucket comes from
   its key, so it never moves), the number of live jobs and the sum of a hash of
   `(originatedFrom, runId, id, seq)` over them, and the same for removals. Equal stores
   give equal digests whatever order the rows were written in.
2. The responder compares with its own digest and answers with its keys and seqs, and its
   removals, in the buckets that differ (`Differences`; at most `MAX_BUCKETS` per round).
3. `plan_repair()` says, from the two sides' keys in those buckets, which records each side
   lacks or holds older, and which removals each lacks. The records go both ways in one
   more round trip; each side writes what it receives, newest seq winning, so a repair sent
   twice changes nothing.

A round where nothing differs costs one digest one way (~90 KB at 100,000 jobs: one entry
per non-empty bucket) and a short answer; `agent.cluster.repair` keeps its store's digest as
the store commits (`broker.digest_book`) rather than reading every key for each round.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Final

from msgspec import Meta, Struct

from workload_manager.workload import Workload, WorkloadRemoval

__all__ = [
    "BUCKETS",
    "MAX_BUCKETS",
    "MAX_KEYS",
    "Differences",
    "Digest",
    "Exchange",
    "ExchangeAnswer",
    "JobKey",
    "RepairPlan",
    "bucket_of",
    "differing",
    "digest",
    "job_hash",
    "job_leaf",
    "keys_in",
    "plan_repair",
    "removal_bucket",
]

BUCKETS: Final = 4096  # ~25 jobs a bucket at 100,000 jobs: a repair sends few extra keys
MAX_BUCKETS: Final = 512  # buckets examined per round; the rest wait for the next rounds
MAX_KEYS: Final = 50_000  # keys per answer, whatever the buckets hold
MAX_RECORDS: Final = 2_000  # records per exchange (a record is at most ~10 KiB)
_MASK: Final = (1 << 63) - 1  # sums mod 2**63: they stay an int64 on the wire

JobKey = tuple[str, str, str]  # (originatedFrom, runId, id)
_Bucket = Annotated[int, Meta(ge=0, lt=BUCKETS)]
_Count = Annotated[int, Meta(ge=0)]
_Sum = Annotated[int, Meta(ge=0, le=_MASK)]
_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_Seq = Annotated[int, Meta(ge=1)]


def job_hash(origin: str, run: str, wid: str) -> int:
    """The hash of a job's key `(originatedFrom, runId, id)`; its bucket is this `% BUCKETS`."""
    return zlib.crc32(f"{origin}\0{run}\0{wid}".encode())


def job_leaf(hashed: int, seq: int) -> int:
    """What a job at `seq` adds to its bucket's sum (= crc32 of its key, then "\\0seq")."""
    return zlib.crc32(f"\0{seq}".encode(), hashed)


def bucket_of(origin: str, run: str, wid: str) -> int:
    """The bucket of a job: from its key only, so a new seq never moves it."""
    return job_hash(origin, run, wid) % BUCKETS


def removal_bucket(origin: str, wid: str) -> int:
    """The bucket of a removal `(originatedFrom, workloadId)`."""
    return zlib.crc32(f"{origin}\0{wid}".encode()) % BUCKETS


class Digest(Struct, frozen=True, kw_only=True):
    """Per non-empty bucket: `[bucket, count, sum]`, for live jobs and for removals."""

    jobs: Annotated[list[tuple[_Bucket, _Count, _Sum]], Meta(max_length=BUCKETS)] = []
    removed: Annotated[list[tuple[_Bucket, _Count, _Sum]], Meta(max_length=BUCKETS)] = []


def digest(rows: Iterable[tuple[str, str, str, int]], removed: Iterable[tuple[str, str]]) -> Digest:
    """The digest of a store's live jobs `(origin, runId, id, seq)` and removals."""
    jobs = _Sums()
    for origin, run, wid, seq in rows:
        key = job_hash(origin, run, wid)
        jobs.add(key % BUCKETS, job_leaf(key, seq))
    gone = _Sums()
    for origin, wid in removed:
        key = zlib.crc32(f"{origin}\0{wid}".encode())
        gone.add(key % BUCKETS, key)
    return Digest(jobs=_listed(jobs), removed=_listed(gone))


class _Sums:
    # Count and sum of leaf hashes per bucket: equal sets give equal sums in any order.
    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.sums: dict[int, int] = {}

    def add(self, bucket: int, leaf: int) -> None:
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.sums[bucket] = (self.sums.get(bucket, 0) + leaf) & _MASK


def _listed(sums: _Sums) -> list[tuple[int, int, int]]:
    return [(b, sums.counts[b], sums.sums[b]) for b in sorted(sums.counts)]


def differing(mine: Digest, theirs: Digest, limit: int = MAX_BUCKETS) -> list[int]:
    """The buckets where the two digests differ (jobs or removals), lowest first."""
    found: set[int] = set()
    for a, b in ((mine.jobs, theirs.jobs), (mine.removed, theirs.removed)):
        left = {bucket: (count, total) for bucket, count, total in a}
        right = {bucket: (count, total) for bucket, count, total in b}
        found.update(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))
    return sorted(found)[:limit]


def keys_in(rows: Iterable[tuple[str, str, str, int]], buckets: set[int]) -> dict[JobKey, int]:
    """The keys and seqs among `rows` that fall in `buckets`."""
    return {(o, r, i): s for o, r, i, s in rows if bucket_of(o, r, i) in buckets}


class Differences(Struct, frozen=True, kw_only=True):
    """The responder's side of the buckets that differ: its keys and seqs, its removals."""

    buckets: Annotated[list[_Bucket], Meta(max_length=MAX_BUCKETS)] = []
    keys: Annotated[list[tuple[_Name, _Name, _Name, _Seq]], Meta(max_length=MAX_KEYS)] = []
    removed: Annotated[list[tuple[_Name, _Name]], Meta(max_length=MAX_KEYS)] = []


class Exchange(Struct, frozen=True, kw_only=True):
    """The initiator's second call: what the responder lacks, and which records it wants."""

    records: Annotated[list[Workload], Meta(max_length=MAX_RECORDS)] = []
    removals: Annotated[list[WorkloadRemoval], Meta(max_length=MAX_KEYS)] = []
    want: Annotated[list[tuple[_Name, _Name, _Name]], Meta(max_length=MAX_RECORDS)] = []


class ExchangeAnswer(Struct, frozen=True, kw_only=True):
    """The records the initiator asked for (those the responder still holds)."""

    records: Annotated[list[Workload], Meta(max_length=MAX_RECORDS)] = []


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """What the initiator does with the responder's `Differences`."""

    want: list[JobKey]  # records the responder holds newer, or that we lack
    give: list[JobKey]  # our records it lacks or holds older
    give_removals: list[tuple[str, str]]  # our removals it lacks: (originatedFrom, id)
    take_removals: list[tuple[str, str]]  # its removals we lack


def plan_repair(
    mine: dict[JobKey, int],
    my_removed: set[tuple[str, str]],
    theirs: Differences,
    *,
    all_my_removed: set[tuple[str, str]] | None = None,
) -> RepairPlan:
    """From our keys and seqs in the differing buckets (`mine`, already narrowed to them),
    our removals in them, and theirs, what each side lacks. A removed job is never asked for
    nor given -- removed here at all (`all_my_removed`, whatever its bucket) or there: the
    removal travels instead, and wins on both sides."""
    their_seq = {(o, r, i): seq for o, r, i, seq in theirs.keys}
    their_removed = {(o, i) for o, i in theirs.removed}
    gone = (all_my_removed or my_removed) | my_removed | their_removed
    want = [
        key
        for key, seq in their_seq.items()
        if (key[0], key[2]) not in gone and mine.get(key, 0) < seq
    ]
    give = [
        key
        for key, seq in mine.items()
        if (key[0], key[2]) not in gone and their_seq.get(key, 0) < seq
    ]
    return RepairPlan(
        want=sorted(want)[:MAX_RECORDS],
        give=sorted(give)[:MAX_RECORDS],
        give_removals=sorted(my_removed - their_removed),
        take_removals=sorted(their_removed - my_removed),
    )
