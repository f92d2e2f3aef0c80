"""The Jobs store on real SQLite files: newest seq wins, removals hold, restart restores."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker.errors import InvalidCursor
from broker.jobs import JobsStore, JobsWriter
from workload_manager.workload import (
    Workload,
    WorkloadRemoval,
    decode_workload,
    encode_workload,
)

STATES = {1: "queued", 2: "running", 3: "completed"}


def rec(wid: str, seq: int, *, origin: str = "nod_a", run: str = "r", **extra: Any) -> Workload:
    body: dict[str, Any] = {
        "id": wid,
        "model": "m",
        "engine": "vllm",
        "runId": run,
        "state": STATES[seq],
        "originatedFrom": origin,
        "createdAt": 1000 + int(wid) if wid.isdigit() else 1000,
        "seq": seq,
        **extra,
    }
    if seq == 3:
        body.setdefault("completedAt", 5000)
    return decode_workload(json.dumps(body))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobsStore]:
    jobs = await JobsStore.open(tmp_path / "jobs.db")
    yield jobs
    await jobs.close()


async def test_wal_mode(store: JobsStore) -> None:
    async with store.db.execute("PRAGMA journal_mode") as cursor:
        assert (await cursor.fetchone()) == ("wal",)


async def test_newest_seq_wins_in_any_order(store: JobsStore) -> None:
    await store.write([rec("1", 2), rec("1", 1), rec("1", 3), rec("1", 2)], [], now=0)
    [job] = await store.jobs()
    assert (job.seq, job.state.value) == (3, "completed")


async def test_records_read_back_exactly(store: JobsStore) -> None:
    original = rec("1", 2, scheduledOn="nod_b", startedAt=None, requesterId="team")
    await store.write([original], [], now=0)
    [job] = await store.jobs()
    assert encode_workload(job) == encode_workload(original)
    assert "completedAt" not in json.loads(encode_workload(job))


async def test_removal_deletes_every_run_and_holds(store: JobsStore) -> None:
    await store.write([rec("1", 1, run="r1"), rec("1", 2, run="r2"), rec("2", 1)], [], now=0)
    await store.write([], [WorkloadRemoval(workloadId="1", originatedFrom="nod_a")], now=1)
    await store.write([rec("1", 3, run="r1")], [], now=2)  # late: stays gone
    assert [j.id for j in await store.jobs()] == ["2"]
    view = await store.view()
    assert view.removed == [WorkloadRemoval(workloadId="1", originatedFrom="nod_a")]


async def test_filters(store: JobsStore) -> None:
    await store.write(
        [rec("1", 1), rec("2", 2, scheduledOn="nod_b"), rec("3", 3, scheduledOn="nod_c")], [], now=0
    )
    assert [j.id for j in await store.jobs(state="running")] == ["2"]
    assert [j.id for j in await store.jobs(node="nod_b")] == ["2"]
    assert [j.id for j in await store.jobs(node="nod_a")] == ["1"]  # queued on its origin
    assert await store.count_by_state() == {"queued": 1, "running": 1, "completed": 1}


async def test_view_pages_cover_everything_once(store: JobsStore) -> None:
    await store.write([rec(str(i), 1) for i in range(25)], [], now=0)
    seen: list[str] = []
    cursor = None
    while True:
        page = await store.view(cursor=cursor, limit=10)
        seen += [w.id for w in page.workloads]
        if page.next is None:
            break
        cursor = page.next
    assert sorted(seen) == sorted(str(i) for i in range(25))


async def test_a_cursor_the_store_did_not_give_out_is_refused(store: JobsStore) -> None:
    await store.write([rec("1", 1), rec("2", 1)], [], now=0)
    page = await store.view(limit=1)
    assert page.next is not None
    assert [w.id for w in (await store.view(cursor=page.next, limit=1)).workloads] == ["2"]
    for foreign in ("page-2", "[1, 2, 3]", '["a", "b"]', "{}"):
        with pytest.raises(InvalidCursor):
            await store.view(cursor=foreign)


async def test_prune_keeps_live_jobs(store: JobsStore) -> None:
    await store.write(
        [rec("1", 1), rec("2", 3)],
        [WorkloadRemoval(workloadId="9", originatedFrom="nod_a")],
        now=10,
    )
    assert await store.prune(older_than_ms=6000, removed_before=11) == 1
    assert [j.id for j in await store.jobs()] == ["1"]
    assert (await store.view()).removed == []


async def test_restart_restores_the_jobs(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = await JobsStore.open(path)
    async with JobsWriter(store) as writer:
        for i in range(500):
            writer.upsert(rec(str(i), 1))
        writer.remove(WorkloadRemoval(workloadId="7", originatedFrom="nod_a"))
    await store.close()
    again = await JobsStore.open(path)
    try:
        assert len(await again.jobs(limit=10_000)) == 499
    finally:
        await again.close()


async def test_group_commit_batches_many_rows_per_transaction(store: JobsStore) -> None:
    async with JobsWriter(store, max_batch=1000) as writer:
        for i in range(3000):
            writer.upsert(rec(str(i), 1))
        await writer.flush()
        assert writer.rows == 3000
        assert writer.commits <= 4  # not one per row
    assert len(await store.jobs(limit=10_000)) == 3000


async def test_writer_coalesces_per_job(store: JobsStore) -> None:
    async with JobsWriter(store) as writer:
        for seq in (1, 2, 3):
            writer.upsert(rec("1", seq))
        writer.upsert(rec("1", 2))
        await writer.flush()
    [job] = await store.jobs()
    assert job.seq == 3


async def test_a_corrupt_database_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(sqlite3.DatabaseError):
        await JobsStore.open(path)
    assert path.read_bytes().startswith(b"this is not a database")  # left for the operator


async def test_a_removal_holds_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = await JobsStore.open(path)
    await store.write(
        [rec("1", 1)], [WorkloadRemoval(workloadId="1", originatedFrom="nod_a")], now=0
    )
    await store.close()
    again = await JobsStore.open(path)
    try:
        await again.write([rec("1", 2)], [], now=1)
        assert await again.jobs() == []
    finally:
        await again.close()


async def test_jobs_pages_cover_the_whole_list_once_newest_first(store: JobsStore) -> None:
    # Equal createdAt across origins and runs: the order is still total.
    records = [rec("1", 1, origin=o, run=r) for o in ("nod_a", "nod_b") for r in ("r1", "r2")]
    records += [rec(str(i), 1) for i in range(2, 9)]
    await store.write(records, [], now=0)
    seen: list[tuple[str, str, str]] = []
    after = None
    for _ in range(20):
        page, after = await store.jobs_page(limit=3, after=after)
        seen += [(j.originatedFrom, j.runId, j.id) for j in page]
        if after is None:
            break
    assert len(seen) == len(set(seen)) == len(records)
    assert [j.id for j in await store.jobs(limit=100)] == [id for _, _, id in seen]
    # A filter holds across pages.
    first, after = await store.jobs_page(node="nod_b", limit=1)
    rest, end = await store.jobs_page(node="nod_b", limit=5, after=after)
    assert {j.originatedFrom for j in first + rest} == {"nod_b"}
    assert (len(first + rest), end) == (2, None)


@pytest.mark.parametrize("cursor", ["", "!!", "bm90IGpzb24", "WzEsMl0", "é"])
async def test_a_jobs_cursor_the_store_did_not_give_out_is_refused(
    store: JobsStore, cursor: str
) -> None:
    with pytest.raises(InvalidCursor):
        await store.jobs_page(after=cursor)


async def test_origins_of_a_job_id_and_its_removal(store: JobsStore) -> None:
    await store.write([rec("1", 1), rec("1", 1, origin="nod_b"), rec("2", 1)], [], now=0)
    assert await store.origins_of("1") == ["nod_a", "nod_b"]
    assert await store.origins_of("9") == []
    assert not store.is_removed("nod_a", "1")
    await store.write([], [WorkloadRemoval(workloadId="1", originatedFrom="nod_a")], now=0)
    assert await store.origins_of("1") == ["nod_b"]
    assert store.is_removed("nod_a", "1")


async def test_a_jobs_page_reads_through_the_index(store: JobsStore) -> None:
    # The plan a page is read by: in the index's order, never a sort of every row.
    await store.write([rec(str(i), 1) for i in range(3)], [], now=0)
    _, after = await store.jobs_page(limit=1)
    assert after is not None
    async with store.db.execute(
        "EXPLAIN QUERY PLAN SELECT record FROM jobs WHERE (created_at, id, origin, run_id) "
        "< (?, ?, ?, ?) ORDER BY created_at DESC, id DESC, origin DESC, run_id DESC LIMIT 5",
        (2000, "x", "y", "z"),
    ) as cursor:
        plan = " ".join(str(row[-1]) for row in await cursor.fetchall())
    assert "jobs_newest" in plan, plan
    assert "TEMP B-TREE" not in plan, plan
