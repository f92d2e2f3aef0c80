"""Group commit in front of the Jobs store: callers hand in, one owned task writes.

`JobsWriter` takes upserts and removals without waiting, and its task writes whatever has
gathered in one transaction (up to `max_batch` rows, or every `interval_s`) -- never a
transaction per row on the hot path. Upserts coalesce per job, the newest `seq` winning.

It never loses a batch and never hangs:

- a write the store refuses (`StoreUnavailable`: locked, read-only, full, failing) is kept
  and retried with backoff (0.1 s doubling to 5 s, for as long as the writer runs); what is
  handed in meanwhile coalesces with it. While it fails, `healthy` is False and `last_error`
  says why (the cause only, never a record);
- `flush(timeout_s=...)` raises `StoreUnavailable` after its bound instead of waiting;
- `upsert_durable(record)` / `remove_durable(removal)` hand one in and return once the
  batch holding it has committed (a record coalesced into a newer one counts as committed
  when the newer one is) -- still group commit, not a transaction of its own -- or raise
  `StoreUnavailable` after the same bound;
- leaving `async with` makes one last bounded attempt, logs how many rows it could not
  write, and stops.

Any other exception is a bug: the task's traceback is logged, `failure` names it, and
`on_failure("jobs-writer", exc)` tells the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from broker.commit_waiters import CommitWaiters
from broker.errors import StoreUnavailable
from netkit.tasks import FailureHandler, describe, reporting
from workload_manager.workload import Workload, WorkloadRemoval

__all__ = ["BatchStore", "JobsWriter"]

log = logging.getLogger(__name__)

PART: Final = "jobs-writer"
FLUSH_TIMEOUT_S: Final = 5.0
CLOSE_TIMEOUT_S: Final = 3.0


class BatchStore(Protocol):
    """What the writer needs of a store: one transaction per batch, or `StoreUnavailable`."""

    async def write(
        self,
        upserts: Iterable[Workload],
        removals: Iterable[WorkloadRemoval],
        *,
        now: float,
        relayed: Sequence[Workload] = (),
    ) -> int:
        """Apply a batch in one transaction: removals first, then upserts and the records the
        relay delivered; how many of those the store already held at that seq or a later one."""


class JobsWriter:
    """Group commit in front of a store; `async with` owns its task."""

    def __init__(
        self,
        store: BatchStore,
        *,
        max_batch: int = 1000,
        interval_s: float = 0.05,
        max_pending: int = 100_000,
        retry_base_s: float = 0.1,
        retry_cap_s: float = 5.0,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        on_failure: FailureHandler | None = None,
    ) -> None:
        self.store = store
        self.max_batch = max_batch
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self.close_timeout_s = close_timeout_s
        self.clock = clock
        self.on_failure = on_failure
        # Coalesced per job. An entry leaves only once written: a batch that fails stays.
        self._upserts: dict[tuple[str, str, str], Workload] = {}
        self._relayed: set[tuple[str, str, str]] = set()  # held upserts the relay delivered
        # Records the relay delivered that the writer or the store already held at that seq
        # or a later one: the duplicates the relay let through (issue 11; 0 when it is right).
        self.redundant = 0
        # After a batch failed with anything but StoreUnavailable (a record the store cannot
        # take: a bug upstream), this many rows are written one at a time to find it; the
        # row that fails alone is dropped (`refused`), logged, and its waiters told.
        self._singles = 0
        self.refused = 0
        self._removals: list[WorkloadRemoval] = []
        # Callers waiting for one job's record to be committed: key -> [(seq, future)].
        self._waiters = CommitWaiters()
        self._removals_in = 0  # removals handed in since start, and of those committed
        self._removals_done = 0
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()  # closing: retry now instead of at the next backoff
        self._written = asyncio.Condition()
        self._writing = False
        self._in_flight: dict[tuple[str, str, str], Workload] = {}
        self._tasks: asyncio.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        self.rows = 0
        self.failed_writes = 0
        self.last_error: str | None = None  # why the store refuses writes, while it does
        self.failure: str | None = None  # why the task died, if it did

    async def __aenter__(self) -> JobsWriter:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._task = self._tasks.create_task(self._main(), name=PART)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._hurry.set()
        try:
            await self.flush(timeout_s=self.close_timeout_s)
        except StoreUnavailable as unavailable:
            log.error(
                "stopping with %d records and removals not written to the Jobs store (%s)",
                self.pending,
                unavailable.reason,
            )
        finally:
            self._waiters.fail_all("the Jobs writer stopped")
            tasks, self._tasks = self._tasks, None
            if self._task is not None:
                self._task.cancel()
            if tasks is not None:
                await tasks.__aexit__(None, None, None)

    @property
    def pending(self) -> int:
        """Records and removals handed in and not yet written (a failing batch included)."""
        return len(self._upserts) + len(self._removals)

    @property
    def healthy(self) -> bool:
        """Whether the last write went through and the task runs."""
        return self.last_error is None and self.failure is None

    def problem(self) -> str | None:
        """Why the writer is not healthy, for a health report; None when it is."""
        return self.failure or self.last_error

    def has_room(self) -> bool:
        """Whether more can be handed in without passing the bound."""
        return self.pending < self.max_pending

    def upsert(self, record: Workload, *, relayed: bool = False) -> None:
        """Hand in a record; the newest `seq` per job wins before it reaches the disk.
        `relayed`: the workload manager delivered it as first seen (counted in `redundant`
        when it was not)."""
        key = (record.originatedFrom, record.runId, record.id)
        held = self._upserts.get(key)
        if held is None or held.seq < record.seq:
            self._upserts[key] = record
            if relayed:
                self._relayed.add(key)
            else:
                self._relayed.discard(key)
        elif relayed:
            self.redundant += 1
        self._wake.set()

    def remove(self, removal: WorkloadRemoval) -> None:
        """Hand in a removal."""
        self._removals.append(removal)
        self._removals_in += 1
        self._wake.set()

    async def upsert_durable(self, record: Workload, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """`upsert(record)`, returning once it (or a newer record of its job) is committed.

        Raises `StoreUnavailable` when that has not happened within `timeout_s` (the record
        is kept and still retried) or when the task died.
        """
        self.upsert(record)
        await self.committed(
            (record.originatedFrom, record.runId, record.id), record.seq, timeout_s
        )

    async def committed(
        self, key: tuple[str, str, str], seq: int, timeout_s: float = FLUSH_TIMEOUT_S
    ) -> None:
        """Wait until the record of job `key` at `seq` handed in earlier is committed: at once
        when nothing of that job is pending; `StoreUnavailable` as for `flush()`."""
        if self.failure is not None:
            raise StoreUnavailable(self.failure)
        if key not in self._upserts and key not in self._in_flight:
            return  # written already (or never handed in: nothing to wait for)
        waiter = self._waiters.add(key, seq)
        await self._wait(waiter[1], timeout_s, lambda: self._waiters.forget(key, waiter))

    async def remove_durable(
        self, removal: WorkloadRemoval, timeout_s: float = FLUSH_TIMEOUT_S
    ) -> None:
        """`remove(removal)`, returning once the batch holding it is committed;
        `StoreUnavailable` as for `flush()`."""
        self.remove(removal)
        ticket = self._removals_in
        if self.failure is not None:
            raise StoreUnavailable(self.failure)
        try:
            async with asyncio.timeout(timeout_s), self._written:
                await self._written.wait_for(
                    lambda: self._removals_done >= ticket or self.failure is not None
                )
        except TimeoutError:
            raise StoreUnavailable(self._why_not(timeout_s)) from None
        if self._removals_done < ticket:
            raise StoreUnavailable(self.failure or "the Jobs writer stopped")

    async def _wait(
        self, done: asyncio.Future[None], timeout_s: float, forget: Callable[[], None]
    ) -> None:
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(done)
        except TimeoutError:
            raise StoreUnavailable(self._why_not(timeout_s)) from None
        finally:
            forget()  # a caller that gave up (timeout, cancel) leaves no waiter behind

    def _why_not(self, timeout_s: float) -> str:
        return self.failure or self.last_error or f"nothing written within {timeout_s:g}s"

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until everything handed in so far is committed.

        Raises `StoreUnavailable` when that has not happened within `timeout_s` (the store
        refuses writes; nothing is lost, it is still retried) or when the task died.
        """
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s), self._written:
                await self._written.wait_for(self._settled)
        except TimeoutError:
            raise StoreUnavailable(self._why_not(timeout_s)) from None
        if self.failure is not None:
            raise StoreUnavailable(self.failure)

    async def wait_for_room(self) -> None:
        """Wait (without a bound: this is backpressure) until `has_room()`."""
        self._wake.set()
        async with self._written:
            await self._written.wait_for(lambda: self.has_room() or self.failure is not None)

    def _full(self) -> bool:
        return len(self._upserts) >= self.max_batch or bool(self._removals)

    def _settled(self) -> bool:
        return self.failure is not None or (not self.pending and not self._writing)

    # -- the task -------------------------------------------------------------------------

    async def _main(self) -> None:
        await reporting(PART, self._run(), self._died)
        # The task died (reporting() returned): wake every flush() so it raises at once
        # instead of waiting out its bound.
        self._waiters.fail_all(self.failure or "the Jobs writer stopped")
        async with self._written:
            self._written.notify_all()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                # Let a group gather before every batch, not only the first: what arrived
                # while one was being written waits for the next interval too, or a steady
                # trickle of requests keeps the store committing back to back, a
                # transaction per event or two (issue 33: a seventh of the agent's time).
                # A full batch, a removal (its caller waits) and closing do not wait.
                if not self._full() and not self._hurry.is_set():
                    await asyncio.sleep(self.interval_s)
                await self._write_batch()
                async with self._written:
                    self._written.notify_all()

    async def _write_batch(self) -> None:
        delay = self.retry_base_s
        while True:
            # Taken afresh on every attempt: what arrived since coalesces into the batch.
            keys = list(itertools.islice(self._upserts, 1 if self._singles else self.max_batch))
            upserts = [self._upserts[key] for key in keys]
            removals = list(self._removals[: 0 if keys else 1] if self._singles else self._removals)
            self._writing = True
            self._in_flight = dict(zip(keys, upserts, strict=True))
            local = [r for k, r in zip(keys, upserts, strict=True) if k not in self._relayed]
            relayed = [r for k, r in zip(keys, upserts, strict=True) if k in self._relayed]
            try:
                redundant = await self.store.write(
                    local, removals, now=self.clock(), relayed=relayed
                )
            except StoreUnavailable as exc:
                self._writing = False
                self._failed(exc.reason, delay)
                async with self._written:
                    self._written.notify_all()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._hurry.wait()
                # Closing hurries one attempt, not a loop of them: left set, a store that
                # keeps refusing was retried ~1,000 times a second for the close bound.
                self._hurry.clear()
                delay = min(self.retry_cap_s, delay * 2)
                continue
            except Exception as exc:
                rows = len(upserts) + len(removals)
                if rows > 1:
                    log.error(
                        "the Jobs store failed a batch of %d rows (%s); writing them one at a "
                        "time to find the one it cannot take",
                        rows,
                        describe(exc),
                    )
                    self._singles = rows
                    continue
                if not await self._store_works():
                    raise  # not this row: the store takes nothing (closed, broken) -- a death
                self._refuse(keys, upserts, removals, exc)
                return
            finally:
                self._writing = False
                self._in_flight = {}
            break
        for key, record in zip(keys, upserts, strict=True):
            if self._upserts.get(key) is record:  # not replaced by a newer one meanwhile
                del self._upserts[key]
                self._relayed.discard(key)
        self.redundant += redundant
        self._singles = max(0, self._singles - 1)
        del self._removals[: len(removals)]
        self._removals_done += len(removals)
        self._waiters.resolve(zip(keys, upserts, strict=True), self._upserts.__contains__)
        if self.last_error is not None:
            log.warning("the Jobs store takes writes again; %d pending", self.pending)
            self.last_error = None
        self.commits += 1
        self.rows += len(upserts) + len(removals)

    async def _store_works(self) -> bool:
        # An empty transaction: whether the store takes writes at all, so that a row is
        # dropped only when it alone is what the store cannot take.
        try:
            await self.store.write([], [], now=self.clock())
        except Exception:
            return False
        return True

    def _refuse(
        self,
        keys: list[tuple[str, str, str]],
        upserts: list[Workload],
        removals: list[WorkloadRemoval],
        exc: Exception,
    ) -> None:
        # The one row a store failed alone: dropped, so it cannot hold up every later write;
        # named by its key only (a record's text never reaches the log).
        self.refused += 1
        self._singles = max(0, self._singles - 1)
        why = f"the Jobs store cannot take this record ({type(exc).__name__})"
        for key, record in zip(keys, upserts, strict=True):
            log.error("dropped job %s seq %d: %s", key, record.seq, describe(exc))
            if self._upserts.get(key) is record:
                del self._upserts[key]
                self._relayed.discard(key)
            self._waiters.fail(key, why)
        for removal in removals:
            log.error(
                "dropped the removal of %s from %s: %s",
                removal.workloadId,
                removal.originatedFrom,
                describe(exc),
            )
            del self._removals[:1]
            self._removals_done += 1

    def _failed(self, reason: str, delay: float) -> None:
        self.failed_writes += 1
        if self.last_error is None:
            log.error(
                "the Jobs store refuses writes (%s); keeping %d rows and retrying",
                reason,
                self.pending,
            )
        else:
            log.debug("the Jobs store still refuses writes (%s); retry in %.1fs", reason, delay)
        self.last_error = reason

    def _died(self, part: str, exc: BaseException) -> None:
        self.failure = describe(exc)
        if self.on_failure is not None:
            self.on_failure(part, exc)
