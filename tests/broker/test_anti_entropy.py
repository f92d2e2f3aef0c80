"""Anti-entropy: digests that say whether two stores differ, plans that say what moves, and
rounds between two real Jobs stores that repair any difference and then move nothing."""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cluster.repair import SETTLE_S, AntiEntropy
from broker.anti_entropy import (
    Differences,
    Digest,
    Exchange,
    ExchangeAnswer,
    differing,
    digest,
    plan_repair,
)
from broker.jobs import JobsStore, JobsWriter
from tests.fixtures.records import workload as old_workload
from workload_manager.workload import WorkloadRemoval

Row = tuple[str, str, str, int]
rows_strategy = st.lists(
    st.tuples(
        st.sampled_from("abc"),
        st.sampled_from("rs"),
        st.text("0123456789", min_size=1, max_size=3),
        st.integers(1, 3),
    ),
    unique_by=lambda row: row[:3],
    max_size=60,
)


@given(rows_strategy, st.randoms())
def test_equal_stores_give_equal_digests_in_any_order(rows: list[Row], rng: random.Random) -> None:
    shuffled = list(rows)
    rng.shuffle(shuffled)
    assert digest(rows, [("a", "1")]) == digest(shuffled, [("a", "1")])
    assert differing(digest(rows, []), digest(shuffled, [])) == []


@given(rows_strategy.filter(bool), st.data())
def test_any_one_difference_is_found(rows: list[Row], data: st.DataObject) -> None:
    victim = data.draw(st.sampled_from(rows))
    changed = [row if row != victim else (*row[:3], row[3] + 1) for row in rows]
    missing = [row for row in rows if row != victim]
    for other in (changed, missing):
        assert len(differing(digest(rows, []), digest(other, []))) == 1
    assert len(differing(digest(rows, []), digest(rows, [("a", "9")]))) == 1


def test_plan_moves_newer_and_missing_records_and_removals_both_ways() -> None:
    mine = {("a", "r", "1"): 2, ("a", "r", "2"): 1, ("a", "r", "3"): 3, ("a", "r", "9"): 1}
    theirs = Differences(
        buckets=[0],
        keys=[("a", "r", "1", 3), ("a", "r", "2", 1), ("b", "r", "4", 1), ("a", "r", "9", 2)],
        removed=[("a", "9")],
    )
    plan = plan_repair(mine, {("b", "5")}, theirs)
    assert plan.want == [("a", "r", "1"), ("b", "r", "4")]  # newer there, or only there
    assert plan.give == [("a", "r", "3")]  # only here; "2" is equal
    # a removal wins: job 9 is neither asked for nor given, and each side learns the other's
    assert plan.take_removals == [("a", "9")]
    assert plan.give_removals == [("b", "5")]


def test_wire_types_round_trip_and_refuse_what_is_out_of_bounds() -> None:
    d = digest([("a", "r", "1", 1)], [])
    assert msgspec.json.decode(msgspec.json.encode(d), type=Digest) == d
    for bad in (b'{"jobs": [[99999, 1, 1]]}', b'{"jobs": [[1, -1, 1]]}', b'{"jobs": 5}'):
        try:
            msgspec.json.decode(bad, type=Digest)
        except msgspec.ValidationError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def workload(wid: str, seq: int, **fields: Any) -> Any:
    # Recent: jobs that finished before the retention are left out of the comparison.
    return old_workload(wid, seq, created_at=int(time.time() * 1000) - 60_000, **fields)


class Side:
    def __init__(
        self,
        store: JobsStore,
        writer: JobsWriter,
        node_id: str,
        *,
        ahead_s: float = 60.0,
        own_runs: Collection[str] = ("r",),  # the fixtures' run: each side made its own rows
    ) -> None:
        self.store, self.writer = store, writer
        self.peer: AntiEntropy | None = None
        # The side's clock runs `ahead_s` ahead of the stores' writes: what they hold has
        # settled (anti-entropy hands on only records a store took SETTLE_S ago or more).
        self.ahead_s = ahead_s
        self.repair = AntiEntropy(
            store=store,
            writer=writer,
            peers=list,
            digest_at=self._digest,
            exchange_at=self._exchange,
            retention_h=168,
            clock=lambda: time.time() + self.ahead_s,
            node_id=node_id,
            own_run=lambda run_id: run_id in own_runs,
        )

    async def _digest(self, node: str, d: Digest) -> Differences:
        assert self.peer is not None
        return await self.peer.answer_digest(d)

    async def _exchange(self, node: str, e: Exchange) -> ExchangeAnswer:
        assert self.peer is not None
        return await self.peer.answer_exchange(e)

    async def view(self) -> dict[tuple[str, str], int]:
        await self.writer.flush()
        return {(j.originatedFrom, j.id): j.seq for j in await self.store.jobs(limit=10_000)}


async def test_rounds_between_two_stores_repair_everything_then_move_nothing(
    tmp_path: Path,
) -> None:
    async with two_stores(tmp_path) as ((sa, wa), (sb, wb)):
        a, b = paired(sa, wa, sb, wb)
        for n in range(300):
            record = workload(str(n), 1 + n % 3, origin="nod_a" if n % 2 else "nod_b")
            wa.upsert(record)
            wb.upsert(record)
        wa.upsert(workload("7", 3, origin="nod_a"))  # newer here
        wb.upsert(workload("8", 3, origin="nod_b"))  # newer there
        wb.upsert(workload("only-b", 1, origin="nod_b"))
        wa.remove(WorkloadRemoval(workloadId="11", originatedFrom="nod_a"))  # removed here only
        await wa.flush()
        await wb.flush()
        # and rows lost from b's store behind its back
        with sqlite3.connect(tmp_path / "b.db") as raw:
            raw.execute("DELETE FROM jobs WHERE id IN ('20', '21', '22')")
        assert await a.view() != await b.view()  # the control: they do differ

        moved = await a.repair.round_with("nod_b")
        assert moved > 0
        # a hands b none of b's own jobs (b is their only writer): b asks back the rows of
        # its own that its store lost, in a round of its own.
        assert {("nod_b", "20"), ("nod_b", "22")}.isdisjoint((await b.view()).keys())
        assert await b.repair.round_with("nod_a") == 2
        assert await a.view() == await b.view()
        view = await a.view()
        assert (view[("nod_a", "7")], view[("nod_b", "8")]) == (3, 3)
        assert ("nod_b", "only-b") in view
        assert ("nod_a", "11") not in view
        assert {("nod_b", "20"), ("nod_a", "21"), ("nod_b", "22")} <= view.keys()
        # Nothing differs any more: the next round, either way, moves nothing.
        assert await a.repair.round_with("nod_b") == 0
        assert await b.repair.round_with("nod_a") == 0


async def test_a_node_asks_back_only_the_lost_rows_of_its_own_runs(tmp_path: Path) -> None:
    # b's store lost a row of its own; a holds that row, and one in b's name of a run b never
    # made (a member planted it: only a node speaks for its own jobs). b's round takes the
    # first back and leaves the second where it is.
    async with two_stores(tmp_path) as ((sa, wa), (sb, wb)):
        _, b = paired(sa, wa, sb, wb)
        mine = workload("lost", 2, origin="nod_b")
        wa.upsert(mine)
        wb.upsert(mine)
        wa.upsert(workload("planted", 1, origin="nod_b", run="never-b"))
        await wa.flush()
        await wb.flush()
        with sqlite3.connect(tmp_path / "b.db") as raw:
            raw.execute("DELETE FROM jobs WHERE id = 'lost'")
        assert await b.repair.round_with("nod_a") == 1
        view = await b.view()
        assert view.get(("nod_b", "lost")) == 2
        assert ("nod_b", "planted") not in view
        assert b.repair.counters.unproven_own == 1
        # Nor in the next round: the difference stays, and b leaves it.
        assert await b.repair.round_with("nod_a") == 0
        assert ("nod_b", "planted") not in await b.view()
        assert b.repair.counters.unproven_own == 2


async def test_a_record_is_handed_on_only_once_it_has_settled(tmp_path: Path) -> None:
    # One a store took moments ago is most likely on its way to the other member through
    # the relay: repairing it too would deliver it there twice.
    async with two_stores(tmp_path) as ((sa, wa), (sb, wb)):
        a, b = Side(sa, wa, "nod_a", ahead_s=0.0), Side(sb, wb, "nod_b", ahead_s=0.0)
        a.peer, b.peer = b.repair, a.repair
        wa.upsert(workload("fresh", 1, origin="nod_a"))
        wb.upsert(workload("theirs", 1, origin="nod_b"))
        await wa.flush()
        await wb.flush()
        assert await a.repair.round_with("nod_b") == 0  # neither side hands on its fresh one
        assert ("nod_a", "fresh") not in await b.view()
        a.ahead_s = b.ahead_s = SETTLE_S + 1  # the control: once settled, both move
        assert await a.repair.round_with("nod_b") == 2
        assert await a.view() == await b.view()


def paired(sa: JobsStore, wa: JobsWriter, sb: JobsStore, wb: JobsWriter) -> tuple[Side, Side]:
    """Sides a and b of two stores, each the other's peer."""
    a, b = Side(sa, wa, "nod_a"), Side(sb, wb, "nod_b")
    a.peer, b.peer = b.repair, a.repair
    return a, b


@contextlib.asynccontextmanager
async def two_stores(tmp_path: Path) -> AsyncIterator[list[tuple[JobsStore, JobsWriter]]]:
    """Two stores with their writers, closed however the test ends (an open store's thread
    would keep the test process alive)."""
    async with contextlib.AsyncExitStack() as stack:
        pairs = []
        for name in "ab":
            store = await JobsStore.open(tmp_path / f"{name}.db")
            stack.push_async_callback(store.close)
            pairs.append((store, await stack.enter_async_context(JobsWriter(store))))
        yield pairs


async def test_rounds_under_writes_follow_the_commits_and_read_the_store_only_when_they_must(
    tmp_path: Path,
) -> None:
    async with two_stores(tmp_path) as ((sa, wa), (sb, wb)):
        a, b = paired(sa, wa, sb, wb)
        for n in range(50):
            record = workload(str(n), 1, origin="nod_a")
            wa.upsert(record)
            wb.upsert(record)
        assert await a.repair.round_with("nod_b") == 0
        loads = (a.repair.counters.loads, b.repair.counters.loads)
        for n in range(50, 80):  # writes between rounds: a's own, b's own, a newer state
            wa.upsert(workload(str(n), 1, origin="nod_a"))
            wb.upsert(workload(f"b{n}", 1, origin="nod_b"))
        wa.upsert(workload("3", 2, origin="nod_a"))
        assert await a.repair.round_with("nod_b") > 0  # what differs is found and moved
        assert await a.view() == await b.view()
        assert await b.repair.round_with("nod_a") == 0
        assert (a.repair.counters.loads, b.repair.counters.loads) == loads  # neither re-read
        wa.remove(WorkloadRemoval(workloadId="4", originatedFrom="nod_a"))
        await wa.flush()
        assert await a.repair.round_with("nod_b") == 1  # the control: a removal re-reads
        assert a.repair.counters.loads == loads[0] + 1
        assert await a.view() == await b.view()


async def test_a_store_read_that_fails_is_read_again_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with two_stores(tmp_path) as ((sa, wa), (sb, wb)):
        a, b = paired(sa, wa, sb, wb)
        for writer in (wa, wb):
            writer.upsert(workload("4", 1, origin="nod_a"))
        assert await a.repair.round_with("nod_b") == 0  # loaded once, nothing differs
        wa.remove(WorkloadRemoval(workloadId="4", originatedFrom="nod_a"))  # a reload is due

        async def failing(store: JobsStore) -> object:
            raise sqlite3.OperationalError("disk I/O error")

        with monkeypatch.context() as patched:
            patched.setattr("agent.cluster.repair.book_rows", failing)
            with pytest.raises(sqlite3.OperationalError):
                await a.repair.round_with("nod_b")
        assert await a.repair.round_with("nod_b") == 1  # read again: b gets the removal
        assert a.repair.counters.loads == 3
        assert await a.view() == await b.view()
