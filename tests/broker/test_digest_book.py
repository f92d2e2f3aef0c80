"""The digest book against the store it follows: after random writes (newer and older seqs,
jobs that finish long ago and lately), removals and a moving cut-off, its digest is the one
`broker.anti_entropy.digest()` computes from the store's own rows, bucket for bucket."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from broker.anti_entropy import digest
from broker.digest_book import MAX_PENDING, DigestBook
from broker.jobs import JobsStore, JobsWriter
from broker.repair_reads import book_rows, compared_keys, compared_removals
from tests.fixtures.records import workload
from workload_manager.workload import WorkloadRemoval

START_MS = 1_764_000_000_000


async def reload(book: DigestBook, store: JobsStore) -> None:
    book.begin_load()
    book.load(await book_rows(store), await compared_removals(store, since=0), 0.0)


async def from_the_store(store: JobsStore, cutoff_ms: int) -> object:
    rows = await compared_keys(store, finished_after_ms=cutoff_ms)
    return digest(rows, await compared_removals(store, since=0))


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_books_digest_is_the_stores_after_writes_removals_and_ageing(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    store = await JobsStore.open(tmp_path / "jobs.db")
    book = DigestBook()
    store.on_written = book.written
    reloads = 0
    try:
        async with JobsWriter(store) as writer:
            await reload(book, store)
            for step in range(40):
                for _ in range(rng.randint(1, 40)):
                    wid, seq = str(rng.randint(0, 120)), rng.randint(1, 3)
                    created = START_MS + rng.randint(0, 100) * 1000
                    extra = (
                        {"completedAt": created + 500} if seq == 3 and rng.random() < 0.7 else {}
                    )
                    origin, run = rng.choice("ab"), rng.choice("rs")
                    writer.upsert(
                        workload(
                            wid, seq, origin=f"nod_{origin}", run=run, created_at=created, **extra
                        )
                    )
                if rng.random() < 0.1:
                    writer.remove(
                        WorkloadRemoval(workloadId=str(rng.randint(0, 120)), originatedFrom="nod_a")
                    )
                await writer.flush()
                if book.stale:  # after a removal: read whole again, as anti-entropy does
                    await reload(book, store)
                    reloads += 1
                cutoff = START_MS + step * 2500  # moves past more and more finished jobs
                assert book.digest(cutoff) == await from_the_store(store, cutoff), step
        assert reloads > 0  # the control: removals did make it stale
    finally:
        await store.close()


async def test_a_prune_or_a_full_backlog_makes_the_book_stale(tmp_path: Path) -> None:
    store = await JobsStore.open(tmp_path / "jobs.db")
    book = DigestBook()
    store.on_written = book.written
    try:
        async with JobsWriter(store) as writer:
            await reload(book, store)
            writer.upsert(workload("1", 3, completedAt=START_MS))
            await writer.flush()
            assert not book.stale  # the control: a plain commit is followed
            assert await store.prune(older_than_ms=START_MS + 1, removed_before=0) == 1
            assert book.stale
            await reload(book, store)
            book.written(
                [("nod_a", "r", "x", 1, "queued", 0, 0, 0, START_MS, None)] * MAX_PENDING, False
            )
            assert not book.stale
            book.written([("nod_a", "r", "y", 1, "queued", 0, 0, 0, START_MS, None)], False)
            assert book.stale
    finally:
        await store.close()


async def test_a_row_another_connection_writes_is_not_followed_so_data_version_reloads(
    tmp_path: Path,
) -> None:
    # The book follows this connection's commits only: what anti-entropy checks SQLite's
    # data_version for (agent.cluster.repair). Here: the book's digest differs until reloaded.
    store = await JobsStore.open(tmp_path / "jobs.db")
    book = DigestBook()
    store.on_written = book.written
    try:
        async with JobsWriter(store) as writer:
            writer.upsert(workload("1", 2))
            await writer.flush()
            await reload(book, store)
            with sqlite3.connect(tmp_path / "jobs.db") as raw:
                raw.execute("DELETE FROM jobs WHERE id = '1'")
            assert book.digest(0) != await from_the_store(store, 0)
            await reload(book, store)
            assert book.digest(0) == await from_the_store(store, 0)
    finally:
        await store.close()
