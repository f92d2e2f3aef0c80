"""The Jobs list's model and requester filters and counts on a real store, and a store from
before them: opened, its `requester` column is added and filled from the stored records."""

from __future__ import annotations

from pathlib import Path

import msgspec

from broker.jobs import JobsStore
from broker.jobs_query import Filters, count_by_state
from tests.fixtures.records import workload_record
from workload_manager.workload import Workload


def job(wid: str, model: str, requester: str | None, state: str = "queued") -> Workload:
    record = workload_record(wid, 1) | {"model": model, "requesterId": requester, "state": state}
    return msgspec.convert(record, Workload)


async def test_filters_and_counts_also_on_a_store_from_before_them(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = await JobsStore.open(path)
    jobs = [
        job("1", "a", "k1"),
        job("2", "a", "k2", "running"),
        job("3", "b", "k1"),
        job("4", "b", None),
    ]
    await store.write(jobs, [], now=0)
    # As an older agent left it: no requester column.
    await store.db.execute("ALTER TABLE jobs DROP COLUMN requester")
    await store.db.commit()
    await store.close()
    store = await JobsStore.open(path)
    try:
        page, _ = await store.jobs_page(requester="k1")
        assert sorted(j.id for j in page) == ["1", "3"]
        page, _ = await store.jobs_page(model="a", requester="k2")
        assert [j.id for j in page] == ["2"]
        assert await count_by_state(store.db, Filters(model="a")) == {"queued": 1, "running": 1}
        assert await count_by_state(store.db, Filters(requester="k1")) == {"queued": 2}
        await store.write([job("5", "b", "k1", "running")], [], now=0)  # written by the upsert
        assert await count_by_state(store.db, Filters(requester="k1", model="b")) == {
            "queued": 1, "running": 1,
        }  # fmt: skip
        assert sum((await count_by_state(store.db, Filters())).values()) == 5
    finally:
        await store.close()
