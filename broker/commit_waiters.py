"""Who waits for which job's commit: the Jobs writer's callers of `upsert_durable`, each
waiting for a job's record at a seq to be in the store (or a newer one of the same job)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from broker.errors import StoreUnavailable
from workload_manager.workload import Workload

__all__ = ["CommitWaiters", "JobKey"]

JobKey = tuple[str, str, str]  # (originatedFrom, runId, id)
Waiter = tuple[int, asyncio.Future[None]]


class CommitWaiters:
    """Futures per job key, resolved when a batch holding the job commits."""

    def __init__(self) -> None:
        self._waiters: dict[JobKey, list[Waiter]] = {}

    def __len__(self) -> int:
        """How many jobs have a waiter."""
        return len(self._waiters)

    def add(self, key: JobKey, seq: int) -> Waiter:
        """A future resolved once `key` is committed at `seq` or later."""
        waiter = (seq, asyncio.get_running_loop().create_future())
        self._waiters.setdefault(key, []).append(waiter)
        return waiter

    def forget(self, key: JobKey, waiter: Waiter) -> None:
        """A caller that gave up (timeout, cancel) leaves no waiter behind."""
        waiters = self._waiters.get(key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]

    def resolve(
        self, written: Iterable[tuple[JobKey, Workload]], still_pending: Callable[[JobKey], bool]
    ) -> None:
        """A batch committed: a waiter for a seq at or below the one written is done (its
        record was that one or coalesced into it); so is every waiter of a job with nothing
        newer pending."""
        for key, record in written:
            waiters = self._waiters.get(key)
            if not waiters:
                continue
            newer_pending = still_pending(key)
            keep = []
            for seq, done in waiters:
                if newer_pending and seq > record.seq:
                    keep.append((seq, done))
                elif not done.done():
                    done.set_result(None)
            if keep:
                self._waiters[key] = keep
            else:
                del self._waiters[key]

    def fail(self, key: JobKey, reason: str) -> None:
        """Every waiter of `key` fails with `StoreUnavailable(reason)`."""
        for _, done in self._waiters.pop(key, []):
            if not done.done():
                done.set_exception(StoreUnavailable(reason))

    def fail_all(self, reason: str) -> None:
        """Every waiter fails with `StoreUnavailable(reason)`."""
        for key in list(self._waiters):
            self.fail(key, reason)
