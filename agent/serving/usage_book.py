"""Where a finished job's usage goes: the node's usage store and `/metrics`.

`UsageBook.record` is the facade's `on_usage`: called once per job as it ends, on the
request path, so it only counts and buffers (the store writes in batches off the path).

The metrics (`usage_metrics`) have bounded labels. `key` is the job's `requesterId` (`none`
without API keys): a key's name, one of the cluster's keys. `model` is the job's model only
once the job was placed (`scheduledOn`), which the facade does only for a model some member
serves; a client's arbitrary model string never gets that far. Past `MAX_LABELS` distinct
values of either, further ones count under `other`.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from agent.serving.usage import Meter
from agent.serving.usage_metrics import UsageMetrics
from agent.serving.usage_store import UsageRow, UsageStore
from workload_manager.workload import Workload

__all__ = ["UsageBook"]


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
