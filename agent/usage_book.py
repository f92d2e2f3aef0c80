"""Where a finished job's usage goes: the node's usage store and `/metrics`.

`UsageBook.record` is the facade's `on_usage`: called once per job as it ends, on the
request path, so it only counts and buffers (the store writes in batches off the path).

The metrics' labels are bounded. `key` is the job's `requesterId` (`none` without API
keys): a key's name, one of the cluster's keys. `model` is the job's model only once the
job was placed (`scheduledOn`), which the facade does only for a model some member serves;
a client's arbitrary model string never gets that far. Past `MAX_LABELS` distinct values of
either, further ones count under `other`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from workload_manager.workload import Workload, WorkloadState

from .metric_labels import MAX_LABELS, OTHER, FirstSeen
from .usage import Meter
from .usage_store import UsageRow, UsageStore

__all__ = ["MAX_LABELS", "UsageBook", "UsageMetrics"]

# Seconds, tens of ms to minutes: a fast first token on a small model, a long prefill
# after a wait in line, a long generation.
_TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class UsageMetrics(Collector):
    """Tokens and requests per model and key, TTFT and duration per model."""

    def __init__(self) -> None:
        # registry=None: registered with the local API's registry by the daemon.
        self.tokens = Counter(
            "nvpair_tokens",
            "Tokens the engines reported for jobs this member originated",
            ["model", "key", "kind"],
            registry=None,
        )
        self.requests = Counter(
            "nvpair_requests",
            "Jobs this member originated, by how they ended",
            ["model", "key", "outcome"],
            registry=None,
        )
        self.ttft = Histogram(
            "nvpair_time_to_first_token_seconds",
            "Time to the first streamed byte of an answer, at the origin",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=None,
        )
        self.duration = Histogram(
            "nvpair_request_duration_seconds",
            "Time from a request to the end of its answer, at the origin",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=None,
        )
        self._model = FirstSeen()
        self._key = FirstSeen()
        # The series of each (model, key, outcome): `labels()` takes a lock and builds a
        # tuple per call; a job's five of them cost ~9 us, the cached ones ~2 us.
        self._series: dict[tuple[str, str, str], tuple[Any, ...]] = {}
        self.store: UsageStore | None = None  # its buffer's gauges, once open

    def count(self, job: Workload, meter: Meter) -> None:
        """Count one finished job."""
        model = self._model(job.model) if isinstance(job.scheduledOn, str) else OTHER
        key = self._key(job.requesterId) if isinstance(job.requesterId, str) else "none"
        outcome = job.state.value
        series = self._series.get((model, key, outcome))
        if series is None:
            series = self._series[(model, key, outcome)] = (
                self.requests.labels(model, key, outcome),
                self.tokens.labels(model, key, "prompt"),
                self.tokens.labels(model, key, "completion"),
                self.ttft.labels(model),
                self.duration.labels(model),
            )
        requests, prompt, completion, ttft_series, duration = series
        requests.inc()
        if meter.usage is not None:
            prompt.inc(meter.usage.prompt)
            completion.inc(meter.usage.completion)
        ttft, total = meter.ttft_ms(), meter.total_ms()
        if ttft is not None and job.state is WorkloadState.COMPLETED:
            ttft_series.observe(ttft / 1000)
        if total is not None:
            duration.observe(total / 1000)

    def collect(self) -> Iterator[Metric]:
        for metric in (self.tokens, self.requests, self.ttft, self.duration):
            yield from metric.collect()
        if self.store is not None:
            pending = GaugeMetricFamily(
                "nvpair_usage_rows_pending", "Usage rows buffered, not yet written to usage.db"
            )
            pending.add_metric([], self.store.pending)
            dropped = GaugeMetricFamily(
                "nvpair_usage_rows_dropped", "Usage rows dropped: the buffer was full"
            )
            dropped.add_metric([], self.store.dropped)
            yield pending
            yield dropped


class UsageBook:
    """The facade's `on_usage`: each finished job into the store and the metrics. Used as
    `async with`: opens `usage.db` beside the Jobs store and runs its writer until closed."""

    def __init__(self, jobs_db: Path, retention_h: float) -> None:
        self._path = jobs_db.with_name("usage.db")
        self._retention_h = retention_h
        self.metrics = UsageMetrics()
        self._store: UsageStore | None = None
        self._writer: asyncio.Task[None] | None = None

    @property
    def store(self) -> UsageStore:
        """The open store (only inside `async with`)."""
        if self._store is None:
            raise RuntimeError("the usage book is not open")
        return self._store

    async def __aenter__(self) -> UsageBook:
        self._store = await UsageStore.open(self._path, retention_h=self._retention_h)
        self.metrics.store = self._store
        self._writer = asyncio.create_task(self._store.run(), name="usage-writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self._store is not None:
            await self._store.close()  # what is still buffered is written

    def record(self, job: Workload, meter: Meter) -> None:
        """One job ended (completed, failed or cancelled)."""
        self.metrics.count(job, meter)
        usage = meter.usage
        completed = job.completedAt if isinstance(job.completedAt, int) else job.createdAt
        self.store.add(
            UsageRow(
                run_id=job.runId,
                id=job.id,
                model=job.model,
                requester=job.requesterId if isinstance(job.requesterId, str) else None,
                prompt_tokens=None if usage is None else usage.prompt,
                completion_tokens=None if usage is None else usage.completion,
                ttft_ms=meter.ttft_ms(),
                total_ms=meter.total_ms(),
                completed_at=completed,
            )
        )
