"""The Jobs writer against a real SQLite file that another connection locks.

A second `sqlite3` connection holding `BEGIN EXCLUSIVE` on the WAL database is what a
stuck backup or a second writer looks like: every write fails after the busy timeout.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest

from broker.errors import StoreUnavailable
from broker.jobs import BUSY_TIMEOUT_S, JobsStore, JobsWriter
from tests.fixtures.records import workload
from tests.fixtures.waiting import eventually
from workload_manager.workload import Workload, WorkloadRemoval


def rec(wid: str, seq: int) -> Workload:
    return workload(wid, seq, **({"completedAt": 5000} if seq == 3 else {}))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobsStore]:
    jobs = await JobsStore.open(tmp_path / "jobs.db")
    yield jobs
    await jobs.close()


class Lock:
    """Another connection holding the database's write lock until released."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("BEGIN EXCLUSIVE")
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.db.execute("COMMIT")
            self.db.close()


@pytest.fixture
def lock(tmp_path: Path, store: JobsStore) -> Iterator[Lock]:
    held = Lock(tmp_path / "jobs.db")
    yield held
    held.release()


async def test_a_write_under_a_held_lock_is_store_unavailable(store: JobsStore, lock: Lock) -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="database is locked"):
        await store.write(
            [rec("1", 1)], [WorkloadRemoval(workloadId="9", originatedFrom="x")], now=0
        )
    assert time.monotonic() - started < BUSY_TIMEOUT_S + 2  # the short busy timeout
    lock.release()
    # Nothing of the refused batch stuck, the removal's in-memory trace included.
    await store.write([rec("9", 1)], [], now=0)
    assert [job.id for job in await store.jobs()] == ["9"]


async def test_a_locked_store_keeps_every_batch_and_says_so(store: JobsStore, lock: Lock) -> None:
    async with JobsWriter(store, interval_s=0.01, retry_cap_s=0.2) as writer:
        assert writer.healthy
        writer.upsert(rec("1", 1))
        await eventually(lambda: not writer.healthy, "the writer reports the store failing")
        assert writer.last_error is not None
        assert "database is locked" in writer.last_error
        assert "nod_a" not in writer.last_error  # the cause, never a record
        with pytest.raises(StoreUnavailable, match="database is locked"):
            await writer.flush(timeout_s=0.5)
        # What arrives while it fails coalesces with the kept batch, newest seq winning.
        writer.upsert(rec("1", 3))
        writer.upsert(rec("1", 2))
        for i in range(2, 6):
            writer.upsert(rec(str(i), 1))
        writer.remove(WorkloadRemoval(workloadId="5", originatedFrom="nod_a"))
        assert writer.pending == 6  # five jobs and one removal
        lock.release()
        await writer.flush(timeout_s=10)
        assert writer.healthy
        assert writer.last_error is None
        assert writer.failed_writes >= 1
    jobs = {job.id: job.seq for job in await store.jobs()}
    assert jobs == {"1": 3, "2": 1, "3": 1, "4": 1}  # nothing lost; 5 removed


async def test_closing_under_a_held_lock_returns_within_its_bound(
    store: JobsStore, lock: Lock, caplog: pytest.LogCaptureFixture
) -> None:
    writer = JobsWriter(store, interval_s=0.01, close_timeout_s=1.0)
    async with writer:
        for i in range(10):
            writer.upsert(rec(str(i), 1))
        await eventually(lambda: not writer.healthy, "the writer reports the store failing")
        started = time.monotonic()
    took = time.monotonic() - started
    # The final attempt's bound, plus at most one write in flight finishing its busy wait.
    assert took < 1.0 + BUSY_TIMEOUT_S + 1.5, took
    assert "10 records and removals not written" in caplog.text


class Picky:
    """A store with a bug: it raises something that is not StoreUnavailable for any batch
    holding a job whose id starts with "poison" -- as an int past SQLite's range did."""

    def __init__(self, store: JobsStore) -> None:
        self.store = store
        self.batches = 0

    async def write(
        self,
        upserts: Iterable[Workload],
        removals: Iterable[WorkloadRemoval],
        *,
        now: float,
        relayed: Sequence[Workload] = (),
    ) -> int:
        self.batches += 1
        upserts, relayed = list(upserts), list(relayed)
        if any(r.id.startswith("poison") for r in [*upserts, *relayed]):
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return await self.store.write(upserts, removals, now=now, relayed=relayed)


async def test_a_record_the_store_cannot_take_is_dropped_alone_and_the_writer_goes_on(
    store: JobsStore, caplog: pytest.LogCaptureFixture
) -> None:
    picky = Picky(store)
    async with JobsWriter(picky, interval_s=0.05) as writer:
        for i in range(10):
            writer.upsert(rec(str(i), 1))
        writer.remove(WorkloadRemoval(workloadId="gone", originatedFrom="nod_a"))
        with pytest.raises(StoreUnavailable, match="cannot take this record"):
            await writer.upsert_durable(rec("poison", 1))
        await writer.flush()
        assert writer.refused == 1
        assert writer.healthy
        # The rest of its batch was written (one at a time), and later batches as usual.
        await writer.upsert_durable(rec("after", 1))
        assert store.is_removed("nod_a", "gone")
    assert sorted(j.id for j in await store.jobs()) == sorted(
        [*(str(i) for i in range(10)), "after"]
    )
    assert "dropped job" in caplog.text
    assert "poison" in caplog.text  # named by its key


class Broken:
    """A store with a worse bug: its write answers something that is not a count."""

    async def write(
        self,
        upserts: Iterable[Workload],
        removals: Iterable[WorkloadRemoval],
        *,
        now: float,
        relayed: Sequence[Workload] = (),
    ) -> int:
        return cast(int, "not a count")


async def test_a_dead_task_is_reported_and_flush_does_not_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failed: list[tuple[str, BaseException]] = []
    async with JobsWriter(
        Broken(), interval_s=0, on_failure=lambda part, exc: failed.append((part, exc))
    ) as writer:
        writer.upsert(rec("1", 1))
        await eventually(lambda: writer.failure is not None, "the writer reports its death")
        assert writer.failure is not None
        assert writer.failure.startswith("TypeError")
        assert not writer.healthy
        assert writer.problem() == writer.failure
        [(part, exc)] = failed
        assert part == "jobs-writer"
        assert isinstance(exc, TypeError)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="TypeError"):
            await writer.flush(timeout_s=30)
        assert time.monotonic() - started < 5  # at once, not after the bound
    assert "Traceback" in caplog.text
    assert "jobs-writer failed" in caplog.text


async def test_backpressure_waits_for_room(store: JobsStore, lock: Lock) -> None:
    async with JobsWriter(store, interval_s=0.01, max_pending=3, retry_cap_s=0.2) as writer:
        for i in range(3):
            writer.upsert(rec(str(i), 1))
        assert not writer.has_room()
        room = asyncio.create_task(writer.wait_for_room())
        await eventually(lambda: not writer.healthy, "the writer reports the store failing")
        assert not room.done()  # the control: the store is still locked
        lock.release()
        await asyncio.wait_for(room, 10)
        assert writer.has_room()


async def test_a_durable_upsert_returns_once_its_batch_is_on_disk(store: JobsStore) -> None:
    async with JobsWriter(store, interval_s=0.05) as writer:
        writer.upsert(rec("2", 1))  # in the same group: one commit, not one per caller
        await writer.upsert_durable(rec("1", 1))
        assert {job.id for job in await store.jobs()} == {"1", "2"}
        assert writer.commits == 1
        # Nothing of that job pending: nothing to wait for.
        await asyncio.wait_for(writer.committed(("nod_a", "r", "1"), 1), 0.01)


async def test_a_record_coalesced_into_a_newer_one_is_committed_with_it(
    store: JobsStore, lock: Lock
) -> None:
    async with JobsWriter(store, interval_s=0.01, retry_cap_s=0.1) as writer:
        first = asyncio.create_task(writer.upsert_durable(rec("1", 1), timeout_s=10))
        await eventually(lambda: not writer.healthy, "the writer reports the store failing")
        second = asyncio.create_task(writer.upsert_durable(rec("1", 2), timeout_s=10))
        assert not first.done()  # the control: locked, nothing is committed
        lock.release()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert [(job.id, job.seq) for job in await store.jobs()] == [("1", 2)]


async def test_a_durable_write_the_store_refuses_is_store_unavailable_then_kept(
    store: JobsStore, lock: Lock
) -> None:
    async with JobsWriter(store, interval_s=0.01, retry_cap_s=0.1) as writer:
        # Once the store has refused (SQLite's busy timeout, longer than a second on a busy
        # machine), a durable write gives up with the reason, not only "nothing written".
        first = asyncio.create_task(writer.upsert_durable(rec("1", 1), timeout_s=30))
        await eventually(lambda: not writer.healthy, "the writer reports the store failing")
        with pytest.raises(StoreUnavailable, match="database is locked"):
            await writer.upsert_durable(rec("1", 1), timeout_s=0.3)
        assert not first.done()  # the control: still waiting, the record kept
        removal = WorkloadRemoval(workloadId="9", originatedFrom="nod_a")
        with pytest.raises(StoreUnavailable, match="database is locked"):
            await writer.remove_durable(removal, timeout_s=0.3)
        assert len(writer._waiters) == 1  # the first, still waiting: those that gave up left none
        lock.release()
        await writer.remove_durable(WorkloadRemoval(workloadId="8", originatedFrom="nod_a"))
        await first  # committed once the store took writes again
        assert [job.id for job in await store.jobs()] == ["1"]  # kept and retried


async def test_a_durable_write_to_a_dead_writer_fails_at_once() -> None:
    async with JobsWriter(Broken(), interval_s=0) as writer:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="TypeError"):
            await writer.upsert_durable(rec("1", 1), timeout_s=30)
        with pytest.raises(StoreUnavailable, match="TypeError"):
            await writer.upsert_durable(rec("2", 1), timeout_s=30)
        assert time.monotonic() - started < 5


async def test_a_relayed_record_the_store_already_holds_is_counted_redundant(
    store: JobsStore,
) -> None:
    async with JobsWriter(store, interval_s=0) as writer:
        # Controls: new records and newer seqs from the relay, and a local record the store
        # has (a client retrying an event), are not redundant.
        writer.upsert(rec("a", 1), relayed=True)
        await writer.flush()
        writer.upsert(rec("a", 2), relayed=True)
        writer.upsert(rec("b", 1))
        await writer.flush()
        writer.upsert(rec("b", 1))
        await writer.flush()
        assert writer.redundant == 0
        # The same seq again and an older one, from the store and from the pending batch.
        writer.upsert(rec("a", 2), relayed=True)
        writer.upsert(rec("a", 1), relayed=True)
        writer.upsert(rec("b", 1), relayed=True)
        await writer.flush()
        assert writer.redundant == 3
        writer.upsert(rec("c", 2), relayed=True)
        writer.upsert(rec("c", 2), relayed=True)  # held already, not yet written
        await writer.flush()
        assert writer.redundant == 4
    assert sorted((j.id, j.seq) for j in await store.jobs()) == [("a", 2), ("b", 1), ("c", 2)]


async def test_a_store_that_takes_nothing_is_a_death_not_a_row_dropped(tmp_path: Path) -> None:
    # A closed database fails every write, empty ones too: no row is to blame, so none is
    # dropped -- the writer dies and says so (the control for "dropped alone" above).
    store = await JobsStore.open(tmp_path / "jobs.db")
    await store.db.close()
    async with JobsWriter(store, interval_s=0) as writer:
        with pytest.raises(StoreUnavailable):
            await writer.upsert_durable(rec("1", 1))
        await eventually(lambda: writer.failure is not None, "the writer reports its death")
        assert writer.refused == 0


class Timed:
    """A store that notes when each batch's write began and ended, and what it held."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, float, list[str]]] = []
        self.writing = asyncio.Event()

    async def write(
        self,
        upserts: Iterable[Workload],
        removals: Iterable[WorkloadRemoval],
        *,
        now: float,
        relayed: Sequence[Workload] = (),
    ) -> int:
        loop = asyncio.get_running_loop()
        began = loop.time()
        self.writing.set()
        ids = [r.id for r in [*upserts, *relayed]]
        await asyncio.sleep(0.01)  # a commit takes time: records keep coming meanwhile
        self.batches.append((began, loop.time(), ids))
        return 0


async def test_records_handed_in_during_a_write_wait_for_the_next_interval() -> None:
    # A steady trickle used to keep the store committing back to back -- a transaction per
    # record or two -- because what came during one write was written right after it.
    store = Timed()
    interval = 0.1
    async with JobsWriter(store, interval_s=interval) as writer:
        writer.upsert(rec("1", 1))
        await store.writing.wait()
        writer.upsert(rec("2", 1))  # during the first write
        writer.upsert(rec("3", 1))
        await writer.flush()
    [(_, first_end, first), (second_begin, _, second)] = store.batches
    assert first == ["1"]
    assert second == ["2", "3"]  # gathered, in one batch
    assert second_begin - first_end >= interval * 0.99  # and not at once after the first


async def test_a_removal_during_a_write_is_written_without_waiting_for_the_interval() -> None:
    store = Timed()
    async with JobsWriter(store, interval_s=30.0) as writer:  # an interval no test waits out
        writer.upsert(rec("1", 1))
        writer.remove(WorkloadRemoval(workloadId="1", originatedFrom="nod_a"))  # control
        await writer.flush(timeout_s=10)  # the removal's caller waits: no interval
    assert len(store.batches) == 1
