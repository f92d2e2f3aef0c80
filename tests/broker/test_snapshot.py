"""Snapshot pages bounded by bytes, over a real Jobs store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from broker.errors import InvalidCursor
from broker.jobs import JobsStore
from broker.snapshot import PAGE_BUDGET, snapshot_page
from tests.fixtures.records import workload
from workload_manager.manager import View
from workload_manager.workload import WorkloadRemoval


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobsStore]:
    jobs = await JobsStore.open(tmp_path / "jobs.db")
    yield jobs
    await jobs.close()


async def all_pages(store: JobsStore, limit: int, budget: int) -> list[View]:
    pages: list[View] = []
    cursor: str | None = None
    while True:
        page = await snapshot_page(store, cursor, limit, budget=budget)
        assert len(msgspec.json.encode(page)) <= budget, "a page over its byte budget"
        pages.append(page)
        if page.next is None:
            return pages
        assert len(pages) < 1000, "paging does not end"
        cursor = page.next


@pytest.mark.parametrize("budget", [2_000, 9_000, PAGE_BUDGET])
async def test_every_record_and_removal_arrives_once_within_the_budget(
    store: JobsStore, budget: int
) -> None:
    records = [workload(f"{i:03}", 1, error="x" * (i * 7 % 900)) for i in range(200)]
    removals = [WorkloadRemoval(workloadId=f"gone{i}", originatedFrom="nod_x") for i in range(60)]
    await store.write(records, removals, now=0)
    pages = await all_pages(store, limit=50, budget=budget)
    got = [record for page in pages for record in page.workloads]
    gone = [removal for page in pages for removal in page.removed]
    assert sorted(got, key=lambda w: w.id) == sorted(records, key=lambda w: w.id)
    assert len(got) == len(records)
    assert sorted(gone, key=lambda r: r.workloadId) == sorted(removals, key=lambda r: r.workloadId)
    assert len(gone) == len(removals)
    if budget == PAGE_BUDGET:
        # The count bound (50) still holds where bytes are no issue: four full pages, and
        # the empty one the store's cursor after a full last page leads to.
        assert [len(page.workloads) for page in pages] == [50, 50, 50, 50, 0]


async def test_a_record_larger_than_the_budget_still_goes_alone(store: JobsStore) -> None:
    await store.write([workload("big", 1, error="x" * 4096)], [], now=0)
    pages = await all_pages(store, limit=10, budget=PAGE_BUDGET)
    assert [w.id for page in pages for w in page.workloads] == ["big"]
    [only] = (await snapshot_page(store, None, 10, budget=100)).workloads
    assert only.id == "big"


async def test_a_cursor_we_never_gave_out_is_the_callers_fault(store: JobsStore) -> None:
    for bad in ["junk", "r:x", "r:-1", "s:[1]"]:
        with pytest.raises(InvalidCursor):
            await snapshot_page(store, bad, 10)
