"""The facade's jobs: one per request, in seed 002's record, numbered per run.

At start the facade mints a `runId` (ULID); each request is a job with `id` from a counter
starting at 1 and `seq` from one event counter, so every change of a job is a new `seq`
(the dedup key, seed 002). The record is built here and nowhere else: its fields are the
seed's 13, and nothing of a prompt or an answer goes in. A job changes only by an event of
its lifecycle's table (`agent.serving.lifecycle`), which also names the method announcing it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from ulid import ULID

from agent.serving.lifecycle import SUBMITTED, JobEvent, step
from workload_manager.workload import Workload, WorkloadState

__all__ = ["Job", "JobBook", "now_ms"]


@dataclass(slots=True)
class Job:
    """A request's job: its latest record and the method that announces it."""

    record: Workload
    method: str = SUBMITTED


class JobBook:
    """Mints jobs and hands every change of one to `submit` (the workload manager)."""

    def __init__(self, node_id: str, submit: Callable[[str, Workload], None]) -> None:
        self.node_id = node_id
        self.run_id = str(ULID())
        self._submit = submit
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)

    def new(self, model: str, engine: str, requester: str | None) -> Job:
        """A queued job, not yet announced."""
        record = Workload(
            id=str(next(self._ids)),
            model=model[:256],
            engine=engine,
            runId=self.run_id,
            state=WorkloadState.QUEUED,
            originatedFrom=self.node_id,
            createdAt=now_ms(),
            startedAt=None,
            completedAt=None,
            error=None,
            requesterId=requester,
            seq=next(self._seq),
        )
        return Job(record)

    def advance(self, job: Job, event: JobEvent) -> None:
        """The job's record after `event` (a new `seq`); `IllegalTransition` when the
        lifecycle's table does not allow it. Announced by `emit`."""
        job.record, job.method = step(job.record, event, seq=next(self._seq), now=now_ms())

    def emit(self, job: Job) -> None:
        """Announce the job's current record with its method (`workload:submitted` for a
        new one, `workload:started`, ...)."""
        self._submit(job.method, job.record)


def now_ms() -> int:
    """Wall-clock milliseconds, the records' time base."""
    return int(time.time() * 1000)
