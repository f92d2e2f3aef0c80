"""Anti-entropy between two members holding 100,000 identical jobs, and a repair (issue 11).

Two real Jobs stores (SQLite files, `JobsStore` + `JobsWriter`), each with its
`AntiEntropy`, call each other in-process through the real wire encoding: every request
and answer is encoded with msgspec JSON and decoded on the other side, and its bytes are
counted, so "bytes per round" is what would cross the network.

Rounds on identical stores, paired (A B, B A, ...):
  baseline: the least any full comparison must do -- every key and seq read from both
            stores (`compared_keys` on each) and compared in a dict;
  subject:  one whole anti-entropy round (`round_with`), both members' work.
For the subject, also the bytes per round (both directions) and the CPU time per round
(`time.process_time()`: the whole process, so both members and SQLite's threads).

Then the same under writes, as on members serving requests: `--writes` new jobs committed
to both stores between rounds (not measured); the subject's round, against the baseline's
full comparison after the same writes -- what a round cost when each one read its store
whole again.

Then 1,000 jobs are made to differ (a quarter newer on each side, a quarter deleted behind
one store's back, a quarter removed on one side) and rounds run until one moves nothing;
both stores' contents are then asserted identical.

    python bench/anti_entropy.py [--jobs 100000] [--differ 1000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
from _interleave import report

from agent.cluster.repair import MARGIN_S, SETTLE_S, AntiEntropy
from broker.anti_entropy import Differences, Digest, Exchange, ExchangeAnswer
from broker.jobs import JobsStore, JobsWriter
from broker.repair_reads import compared_keys
from workload_manager.workload import Workload, WorkloadRemoval, WorkloadState

RETENTION_H: Final = 168.0
ORIGINS: Final = tuple(f"nod_01jd8x3c5v0q2k9m4t7w1y6z{n:02d}" for n in range(4))
STATES: Final = {1: WorkloadState.QUEUED, 2: WorkloadState.RUNNING, 3: WorkloadState.COMPLETED}
FILL_BATCH: Final = 5_000  # rows per transaction while filling: filling is not measured

_T = TypeVar("_T")
_encode: Final = msgspec.json.Encoder().encode
_digest: Final = msgspec.json.Decoder(Digest)
_differences: Final = msgspec.json.Decoder(Differences)
_exchange: Final = msgspec.json.Decoder(Exchange)
_exchange_answer: Final = msgspec.json.Decoder(ExchangeAnswer)


def job(i: int, seq: int, now_ms: int) -> Workload:
    """Job `i` at lifecycle step `seq`, created a minute ago (recent: it is compared)."""
    created = now_ms - 60_000 - i
    done = seq == 3
    return Workload(
        id=f"wl_{i:08d}",
        model="meta-llama/Llama-3.1-8B-Instruct",
        engine="vllm",
        runId=f"run-{i % 50:03d}",
        state=STATES[seq],
        originatedFrom=ORIGINS[i % len(ORIGINS)],
        scheduledOn=ORIGINS[(i + 1) % len(ORIGINS)],
        createdAt=created,
        startedAt=created + 500 if seq >= 2 else None,
        completedAt=created + 9_000 if done else None,
        error=None,
        requesterId="team-search",
        seq=seq,
    )


@dataclass
class Wire:
    """Bytes that crossed the (in-process) wire, both directions."""

    sent: int = 0
    # Removals the initiator hands over: `round_with` leaves them out of what it says moved.
    removals_given: int = 0

    def cross(self, value: Any, decoder: msgspec.json.Decoder[_T]) -> _T:
        """Encode `value` as the sender would, count it, decode it as the receiver would."""
        data = _encode(value)
        self.sent += len(data)
        return decoder.decode(data)


class Member:
    """One member: its store, its writer and its `AntiEntropy`, calling `peer` over `wire`."""

    def __init__(self, path: Path, wire: Wire) -> None:
        self.path = path
        self.wire = wire
        self.peer: Member | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Member:
        self.store = await JobsStore.open(self.path)
        self._stack.push_async_callback(self.store.close)
        self.writer = await self._stack.enter_async_context(JobsWriter(self.store))
        self.repair = AntiEntropy(
            store=self.store,
            writer=self.writer,
            peers=list,
            digest_at=self._digest_at,
            exchange_at=self._exchange_at,
            retention_h=RETENTION_H,
            # Ahead of the writes: the records were stored moments ago, and a repair hands
            # on only what settled (SETTLE_S); the bench times the repair, not the wait.
            clock=lambda: time.time() + 2 * SETTLE_S,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _digest_at(self, node: str, digest: Digest) -> Differences:
        assert self.peer is not None
        answer = await self.peer.repair.answer_digest(self.wire.cross(digest, _digest))
        return self.wire.cross(answer, _differences)

    async def _exchange_at(self, node: str, exchange: Exchange) -> ExchangeAnswer:
        assert self.peer is not None
        received = self.wire.cross(exchange, _exchange)
        self.wire.removals_given += len(received.removals)
        answer = await self.peer.repair.answer_exchange(received)
        return self.wire.cross(answer, _exchange_answer)

    async def keys(self) -> list[tuple[str, str, str, int]]:
        """What `AntiEntropy` compares of this store, with the same cut-off."""
        cutoff = time.time() - RETENTION_H * 3600 + MARGIN_S
        return await compared_keys(self.store, finished_after_ms=int(cutoff * 1000))

    async def contents(self) -> tuple[dict[tuple[str, str, str], bytes], set[tuple[str, str]]]:
        """Every job's stored record by key, and every removal: the whole view."""
        await self.writer.flush()
        async with self.store.db.execute("SELECT origin, run_id, id, record FROM jobs") as cur:
            jobs = {(str(o), str(r), str(i)): bytes(rec) for o, r, i, rec in await cur.fetchall()}
        async with self.store.db.execute("SELECT origin, id FROM removed") as cur:
            removed = {(str(o), str(i)) for o, i in await cur.fetchall()}
        return jobs, removed


@contextlib.asynccontextmanager
async def pair(tmp: Path) -> AsyncIterator[tuple[Member, Member, Wire]]:
    """Two members wired to each other through one byte-counting wire."""
    wire = Wire()
    async with Member(tmp / "a.db", wire) as a, Member(tmp / "b.db", wire) as b:
        a.peer, b.peer = b, a
        yield a, b, wire


async def fill(members: tuple[Member, Member], count: int, now_ms: int) -> None:
    """The same `count` jobs in both stores, in big transactions (not measured)."""
    for start in range(0, count, FILL_BATCH):
        batch = [job(i, 1 + i % 3, now_ms) for i in range(start, min(count, start + FILL_BATCH))]
        for member in members:
            await member.store.write(batch, [], now=now_ms / 1000)


async def full_comparison(a: Member, b: Member) -> tuple[float, float]:
    """Baseline: read every key and seq from both stores, compare in a dict.
    Rounds/s, and CPU seconds."""
    cpu, start = time.process_time(), time.perf_counter()
    mine = {row[:3]: row[3] for row in await a.keys()}
    theirs = {row[:3]: row[3] for row in await b.keys()}
    differ = [k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert not differ, f"{len(differ)} keys differ between identical stores"
    return 1 / elapsed, cpu


@dataclass
class RoundCost:
    """What one subject round cost: wall seconds, CPU seconds, bytes both ways."""

    wall_s: float
    cpu_s: float
    wire_bytes: int


async def one_round(a: Member, wire: Wire) -> tuple[int, RoundCost]:
    """One anti-entropy round, `a` initiating: records and removals moved, and its cost."""
    sent, given = wire.sent, wire.removals_given
    cpu, start = time.process_time(), time.perf_counter()
    moved = await a.repair.round_with("b")
    cost = RoundCost(time.perf_counter() - start, time.process_time() - cpu, wire.sent - sent)
    return moved + wire.removals_given - given, cost


async def compare_rounds(
    a: Member, b: Member, wire: Wire, rounds: int
) -> tuple[list[tuple[float, float]], list[float], list[RoundCost]]:
    """Paired rounds (A B, B A, ...) on identical stores; both sides' rates, subject costs."""
    base: list[tuple[float, float]] = []
    subject: list[float] = []
    costs: list[RoundCost] = []

    async def run_subject() -> None:
        moved, cost = await one_round(a, wire)
        assert moved == 0, f"a round between identical stores moved {moved}"
        subject.append(1 / cost.wall_s)
        costs.append(cost)

    await run_subject()  # warm-up, not counted: the first round of a store reads it cold
    subject.clear()
    costs.clear()
    for i in range(rounds):
        if i % 2 == 0:
            base.append(await full_comparison(a, b))
            await run_subject()
        else:
            await run_subject()
            base.append(await full_comparison(a, b))
    return base, subject, costs


async def rounds_under_writes(
    a: Member, b: Member, wire: Wire, rounds: int, writes: int, first: int, now_ms: int
) -> None:
    """Paired rounds with `writes` new jobs in both stores before each; prints the medians."""
    base_cpu: list[float] = []
    costs: list[RoundCost] = []
    for i in range(rounds):
        batch = [job(first + i * writes + n, 1, now_ms) for n in range(writes)]
        for member in (a, b):
            for record in batch:
                member.writer.upsert(record)
            await member.writer.flush()
        if i % 2 == 0:
            base_cpu.append((await full_comparison(a, b))[1])
        moved, cost = await one_round(a, wire)
        assert moved == 0, f"a round between identical stores moved {moved}"
        costs.append(cost)
        if i % 2 == 1:
            base_cpu.append((await full_comparison(a, b))[1])
    print(
        f"under writes ({writes:,} new jobs in both stores between rounds): subject round "
        f"(median) {statistics.median(c.cpu_s for c in costs) * 1000:,.1f} ms CPU (both "
        f"members), {statistics.median(c.wall_s for c in costs) * 1000:,.1f} ms wall; "
        f"baseline (every key read again) {statistics.median(base_cpu) * 1000:,.0f} ms CPU"
    )


async def make_differ(a: Member, b: Member, count: int, jobs: int, now_ms: int) -> None:
    """`count` jobs made to differ: a quarter newer on a, a quarter newer on b, a quarter
    deleted from b's file behind its back, a quarter removed on a."""
    rng = random.Random(11)
    advanceable = [i for i in range(jobs) if i % 3 != 2]  # seq 1 or 2: can move on
    newer = rng.sample(advanceable, count // 2)
    rest = rng.sample(sorted(set(range(jobs)) - set(newer)), count - count // 2)
    newer_a, newer_b = newer[: count // 4], newer[count // 4 :]
    deleted, removed = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    for i in newer_a:
        a.writer.upsert(job(i, 2 + i % 3, now_ms))
    for i in newer_b:
        b.writer.upsert(job(i, 2 + i % 3, now_ms))
    for i in removed:
        a.writer.remove(
            WorkloadRemoval(workloadId=f"wl_{i:08d}", originatedFrom=ORIGINS[i % len(ORIGINS)])
        )
    await a.writer.flush()
    await b.writer.flush()
    with contextlib.closing(sqlite3.connect(b.path)) as raw, raw:
        raw.executemany("DELETE FROM jobs WHERE id = ?", [(f"wl_{i:08d}",) for i in deleted])


async def repair(a: Member, b: Member, wire: Wire, differ: int) -> None:
    """Rounds until one moves nothing; prints their number, bytes and time; asserts both
    stores then hold the same jobs and removals."""
    (jobs_a, _), (jobs_b, _) = await a.contents(), await b.contents()
    found = sum(jobs_a.get(k) != jobs_b.get(k) for k in jobs_a.keys() | jobs_b.keys())
    assert found == differ, f"the control: {differ} jobs should differ, {found} do"
    moving: list[tuple[int, RoundCost]] = []
    start = time.perf_counter()
    while True:
        moved, cost = await one_round(a, wire)
        if not moved:
            break
        moving.append((moved, cost))
        assert len(moving) < 50, "anti-entropy does not converge"
    await a.writer.flush()  # the last round's records are written, not only handed in
    await b.writer.flush()
    elapsed = time.perf_counter() - start
    assert await a.contents() == await b.contents(), "repair left the stores different"
    moved_total = sum(m for m, _ in moving)
    bytes_total = sum(c.wire_bytes for _, c in moving) + cost.wire_bytes
    print(
        f"repair of {differ:,} differing jobs: {len(moving)} round(s) moved "
        f"{moved_total:,} records and removals ({' + '.join(str(m) for m, _ in moving)}; "
        f"records a store drops as already removed count too), then 1 round moved nothing"
    )
    print(
        f"repair: {elapsed:.2f} s wall until that round returned and both stores are "
        f"written, {bytes_total:,} bytes both ways in all"
    )
    for n, (moved, c) in enumerate([*moving, (0, cost)], 1):
        print(
            f"  repair round {n}: moved {moved:,}, {c.wall_s:.3f} s wall, "
            f"{c.cpu_s:.3f} s CPU, {c.wire_bytes:,} bytes"
        )


async def main_async(jobs: int, differ: int, rounds: int, writes: int) -> None:
    """Fill both stores, compare rounds, repair, then print the round comparison's ratio."""
    now_ms = int(time.time() * 1000)
    with tempfile.TemporaryDirectory() as tmp:
        async with pair(Path(tmp)) as (a, b, wire):
            start = time.perf_counter()
            await fill((a, b), jobs, now_ms)
            took = time.perf_counter() - start
            print(f"filled two stores with {jobs:,} identical jobs in {took:.1f} s")
            base, subject, costs = await compare_rounds(a, b, wire, rounds)
            print_round_costs(base, subject, costs)
            await rounds_under_writes(a, b, wire, rounds, writes, jobs, now_ms)
            await make_differ(a, b, differ, jobs, now_ms)
            await repair(a, b, wire, differ)
    # rounds/min: `report` prints whole numbers, and a round takes a good part of a second
    report(
        [rate * 60 for rate, _ in base],
        [rate * 60 for rate in subject],
        unit="rounds/min",
        label=f"anti-entropy round, {jobs:,} jobs:",
    )


def print_round_costs(
    base: list[tuple[float, float]], subject: list[float], costs: list[RoundCost]
) -> None:
    """Medians: both sides' rounds/s and CPU time, the subject's bytes both ways."""
    base_cpu = statistics.median(cpu for _, cpu in base) * 1000
    print(
        f"rounds/s (median): baseline {statistics.median(r for r, _ in base):.2f}, "
        f"subject {statistics.median(subject):.2f}"
    )
    print(
        f"subject round (median): {statistics.median(c.wire_bytes for c in costs):,.0f} bytes "
        f"both ways, {statistics.median(c.cpu_s for c in costs) * 1000:,.0f} ms CPU (both "
        f"members), {statistics.median(c.wall_s for c in costs) * 1000:,.0f} ms wall; "
        f"baseline {base_cpu:,.0f} ms CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--differ", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--writes", type=int, default=2_000, help="new jobs between rounds")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("at least 5 paired rounds (STYLE.md)")
    if not 4 <= args.differ <= args.jobs // 2:
        parser.error("--differ is between 4 and half of --jobs")
    asyncio.run(main_async(args.jobs, args.differ, args.rounds, args.writes))


if __name__ == "__main__":
    main()
