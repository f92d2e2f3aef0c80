"""The agent's Prometheus gauges read at scrape time: the Jobs writer's backlog
(`nvpair_jobs_writer_pending`), which the soak (tests/reliability/test_soak.py) samples to
show that no backlog grows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics import AgentMetrics
from broker.inventory import GpuInventory
from broker.jobs import JobsStore, JobsWriter
from tests.fixtures.records import workload
from tests.fixtures.waiting import eventually


def scrape(registry: CollectorRegistry, name: str) -> float:
    """The one sample named `name` in the registry's text exposition."""
    text = generate_latest(registry).decode()
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]
    assert len(values) == 1, (name, values)
    return float(values[0])


async def test_the_jobs_writers_pending_rows_are_a_gauge(tmp_path: Path) -> None:
    store = await JobsStore.open(tmp_path / "jobs.db")
    try:
        async with JobsWriter(store, interval_s=0.01, retry_cap_s=0.2) as writer:
            registry = CollectorRegistry()
            registry.register(
                AgentMetrics(
                    lambda: GpuInventory(),
                    lambda: 0,
                    writer_pending=lambda: writer.pending,
                )
            )
            assert scrape(registry, "nvpair_jobs_writer_pending") == 0
            # Another connection holding the write lock: the writer keeps what it is handed.
            lock = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")
            try:
                for n in range(3):
                    writer.upsert(workload(f"w{n}", 1))
                await eventually(lambda: not writer.healthy, "the writer sees the lock")
                assert scrape(registry, "nvpair_jobs_writer_pending") == 3
            finally:
                lock.execute("COMMIT")
                lock.close()
            # The control: once the store takes writes again, the backlog is gone.
            await writer.flush(timeout_s=10)
            assert scrape(registry, "nvpair_jobs_writer_pending") == 0
    finally:
        await store.close()
