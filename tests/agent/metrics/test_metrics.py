"""The agent's Prometheus metrics read at scrape time: the Jobs writer's backlog
(`nvpair_jobs_writer_pending`), which the soak (tests/reliability/test_soak.py) samples to
show that no backlog grows; the anti-entropy's counts, counters each with its own HELP."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.cluster.repair import RepairCounters
from agent.metrics.agent import REPAIRS, AgentMetrics
from broker.jobs import JobsStore, JobsWriter
from facts.inventory import GpuInventory
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


def test_every_anti_entropy_count_is_a_counter_with_its_own_help() -> None:
    assert set(REPAIRS) == {f.name for f in dataclasses.fields(RepairCounters)}
    registry = CollectorRegistry()
    registry.register(
        AgentMetrics(lambda: GpuInventory(), lambda: 2, repairs=lambda: {"rounds": 7})
    )
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    counters = {f.name: f for f in families if f.type == "counter"}
    for name in REPAIRS:
        assert f"nvpair_anti_entropy_{name}" in counters, name
    assert scrape(registry, "nvpair_anti_entropy_rounds_total") == 7
    assert scrape(registry, "nvpair_anti_entropy_rounds") == 7  # deprecated, one release
    assert scrape(registry, "nvpair_manager_restarts_total") == 2
    helps = [counters[f"nvpair_anti_entropy_{name}"].documentation for name in REPAIRS]
    assert len(set(helps)) == len(REPAIRS)
