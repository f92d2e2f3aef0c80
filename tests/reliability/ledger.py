"""A client that remembers what it was told: it enters lifecycle events through `POST
/v1/jobs/events` at each job's origin, in seq order, records every one acknowledged (202),
and at the end compares every member's whole Jobs list with what it was told.

The comparison is exact: each member lists, for every job with an acknowledged event, the
state of its highest acknowledged seq -- nothing lost, nothing extra, no member different
from another. An event the client could not get an answer for (no 202 after its retries)
may or may not be in the store; such a job may show either state, and is counted.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from tests.agent.harness import JobKey, job_key
from tests.fixtures.records import STATES, lifecycle_event, workload_record
from tests.fixtures.waiting import eventually

from .cluster import Member

__all__ = ["Divergence", "Figures", "RememberingClient"]

TRIES: Final = 40  # per event: a member restarting its manager answers again within seconds
RETRY_PAUSE_S: Final = 0.25
REQUEST_TIMEOUT_S: Final = 10.0
PAGE: Final = 500


@dataclass
class Figures:
    """What a scenario did, for its report line and docs/reliability.md."""

    events_sent: int = 0
    accepted: int = 0  # events answered 202
    retried: int = 0  # answers other than 202 (or none) that were tried again
    unacknowledged: int = 0  # events never answered 202 after every try
    jobs: int = 0
    lost: int = 0  # (member, job) pairs missing or older than acknowledged
    extra: int = 0  # (member, job) pairs listed that were never acknowledged, or newer
    diverged: int = 0  # members whose list differs from what the client was told
    duplicates: int = 0  # records the relays delivered to a broker that it already held
    converge_s: float = 0.0  # from the end of the faults until every member agreed
    after_load_s: float | None = None  # from the end of the last load until they agreed

    def line(self, scenario: str) -> str:
        return (
            f"{scenario}: events accepted {self.accepted} (jobs {self.jobs}, retried "
            f"{self.retried}, unacknowledged {self.unacknowledged}), lost {self.lost}, "
            f"extra {self.extra}, duplicates {self.duplicates}, diverged {self.diverged}, "
            f"converged in {self.converge_s:.1f}s"
            + (
                f" ({self.after_load_s:.1f}s after the load)"
                if self.after_load_s is not None
                else ""
            )
        )


@dataclass
class Divergence:
    """How one member's Jobs list differs from what the client was told."""

    member: str
    missing: list[JobKey] = field(default_factory=list)
    older: list[JobKey] = field(default_factory=list)
    newer: list[JobKey] = field(default_factory=list)
    unknown: list[JobKey] = field(default_factory=list)
    unlike_first: list[JobKey] = field(default_factory=list)  # differs from the first member

    def __bool__(self) -> bool:
        return bool(self.missing or self.older or self.newer or self.unknown or self.unlike_first)

    def __str__(self) -> str:
        parts = [
            f"{name} {len(keys)} (e.g. {keys[:3]})"
            for name, keys in (
                ("missing", self.missing),
                ("older", self.older),
                ("newer", self.newer),
                ("never acknowledged", self.unknown),
                ("unlike the first member", self.unlike_first),
            )
            if keys
        ]
        return f"{self.member}: " + ", ".join(parts)


class RememberingClient:
    """Enters events and remembers each acknowledgement; `async with` owns its session."""

    def __init__(
        self,
        rng: random.Random,
        *,
        sized: bool = False,
        others: Callable[[JobKey], bool] = lambda key: False,
    ) -> None:
        self.rng = rng
        # Jobs other clients made (a facade's inference jobs beside this client's events):
        # not held against what this client was told, still compared between members.
        self.others = others
        self.sized = sized  # records of every legal size (4 KiB error texts), not small ones
        self.figures = Figures()
        self.acked: dict[JobKey, int] = {}  # job -> highest seq answered 202
        self.maybe: dict[JobKey, int] = {}  # job -> a seq sent but never answered 202
        self._session: aiohttp.ClientSession | None = None
        self._load_ended: float | None = None
        self._carried = 0  # duplicates counted by agents since killed (their counters gone)

    async def __aenter__(self) -> RememberingClient:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    async def enter(self, member: Member, record: dict[str, Any]) -> bool:
        """POST one lifecycle event at `member` until it is answered 202 (bounded); whether
        it was. Only a 202 is remembered as told."""
        assert self._session is not None
        key = job_key(record)
        url = member.node.api + "/v1/jobs/events"
        self.figures.events_sent += 1
        for _ in range(TRIES):
            try:
                # The token read at each try: a restarted member issued a new one.
                event = lifecycle_event(record)
                async with self._session.post(
                    url, json=event, headers=member.node.owner
                ) as response:
                    status = response.status
                    await response.read()
            except (aiohttp.ClientError, TimeoutError):
                status = None
            if status == 202:
                self.figures.accepted += 1
                self.acked[key] = max(self.acked.get(key, 0), record["seq"])
                self.maybe.pop(key, None)
                return True
            self.figures.retried += 1
            self.maybe[key] = record["seq"]
            await asyncio.sleep(RETRY_PAUSE_S)  # a retry's pacing, not a wait for a result
        self.figures.unacknowledged += 1
        return False

    async def load(
        self,
        members: list[Member],
        *,
        jobs: int,
        rate_per_s: float,
        prefix: str,
        workers: int = 4,
    ) -> None:
        """Enter `jobs` jobs at random origins, each taken to a random last state (queued,
        running or completed) one seq at a time, by `workers` concurrent posters at about
        `rate_per_s` events a second in all; a job whose event is never acknowledged gets
        no later ones."""
        now = int(time.time() * 1000)
        plans: list[list[tuple[Member, dict[str, Any]]]] = [[] for _ in range(workers)]
        for n in range(jobs):
            origin = self.rng.choice(members)
            last = self.rng.randint(1, 3)
            plan = plans[n % workers]
            for seq in range(1, last + 1):
                record = workload_record(
                    f"{prefix}-{n}",
                    seq,
                    origin=origin.node_id,
                    run=f"{prefix}-run",
                    created_at=now,
                    **(self._sizes() if self.sized else {}),
                )
                plan.append((origin, record))
        for plan in plans:
            _interleave(plan, self.rng)
        self.figures.jobs += jobs
        pause = workers / rate_per_s
        async with asyncio.TaskGroup() as posters:
            for plan in plans:
                posters.create_task(self._post_all(plan, pause))
        self._load_ended = time.monotonic()

    def _sizes(self) -> dict[str, Any]:
        # The free-text fields at lengths up to their bounds (seed 002's record; the bounds
        # of workload_manager/workload.py): a third small, a third middling, a third at the
        # largest, so pages and frames meet records of ~9 KiB as well as of ~200 bytes.
        def text(bound: int) -> str:
            kind = self.rng.randrange(3)
            length = (self.rng.randint(1, 16), self.rng.randint(17, bound - 1), bound)[kind]
            return self.rng.choice("abcdefghijklmnopqrstuvwxyz") * length

        return {"model": text(256), "error": text(4096), "requesterId": text(256)}

    async def _post_all(self, plan: list[tuple[Member, dict[str, Any]]], pause: float) -> None:
        given_up: set[JobKey] = set()
        for member, record in plan:
            if job_key(record) in given_up:
                continue
            if not await self.enter(member, record):
                given_up.add(job_key(record))
            await asyncio.sleep(pause)  # the load's pace

    # -- the comparison ------------------------------------------------------------------------

    async def divergences(self, members: list[Member]) -> list[Divergence]:
        """Each member's difference from what the client was told (empty when none)."""
        assert self._session is not None
        found = []
        first: dict[JobKey, int] | None = None
        for member in members:
            listed = await list_jobs(self._session, member)
            diff = Divergence(member.name)
            for key, seq in self.acked.items():
                have = listed.get(key)
                allowed = {seq, self.maybe.get(key, seq)}
                if have is None:
                    diff.missing.append(key)
                elif have not in allowed:
                    (diff.older if have < seq else diff.newer).append(key)
            diff.unknown = [
                k
                for k in listed
                if k not in self.acked and k not in self.maybe and not self.others(k)
            ]
            # Where the client cannot tell (an event never answered), members must still agree.
            first = listed if first is None else first
            diff.unlike_first = [
                k for k in first.keys() | listed.keys() if first.get(k) != listed.get(k)
            ]
            found.append(diff)
        return found

    async def wait_converged(
        self, members: list[Member], *, within_s: float = 30.0, since: float | None = None
    ) -> None:
        """Until every member lists exactly what the client was told; records the figures
        (the time to converge counted from `since`, a `time.monotonic()` such as the heal,
        else from now), and fails naming every difference when that does not happen within
        `within_s`."""
        start = time.monotonic() if since is None else since
        diffs: list[Divergence] = []

        async def converged() -> bool:
            nonlocal diffs
            diffs = await self.divergences(members)
            return not any(diffs)

        try:
            await eventually(converged, "every member lists what it was told", within_s=within_s)
        finally:
            now = time.monotonic()
            self.figures.converge_s = now - start
            if self._load_ended is not None:
                self.figures.after_load_s = max(0.0, now - self._load_ended)
            self.figures.lost = sum(len(d.missing) + len(d.older) for d in diffs)
            self.figures.extra = sum(len(d.newer) + len(d.unknown) for d in diffs)
            self.figures.diverged = sum(1 for d in diffs if d)
        bad = [str(d) for d in diffs if d]
        assert not bad, "; ".join(bad)
        self.figures.duplicates = self._carried + await duplicates_delivered(members)

    async def before_kill(self, members: list[Member]) -> None:
        """Keep the duplicates `members` counted so far: an agent's counters die with it.
        (What one counts between this and the kill is not seen.)"""
        self._carried += await duplicates_delivered(members)

    def states(self) -> dict[JobKey, str]:
        """What the client was told, as each job's state."""
        return {key: STATES[seq] for key, seq in self.acked.items()}


async def list_jobs(session: aiohttp.ClientSession, member: Member) -> dict[JobKey, int]:
    """A member's whole Jobs list, paged through with `page=1` and `after=`: job -> seq."""
    listed: dict[JobKey, int] = {}
    url = f"{member.node.api}/v1/jobs?page=1&limit={PAGE}"
    while True:
        async with session.get(url, headers=member.node.owner) as response:
            assert response.status == 200, await response.text()
            page = await response.json()
        for job in page["jobs"]:
            key = job_key(job)
            assert key not in listed, f"{member.name} lists {key} twice"
            listed[key] = int(job["seq"])
        if page["next"] is None:
            return listed
        url = f"{member.node.api}/v1/jobs?limit={PAGE}&after={page['next']}"


async def duplicates_delivered(members: list[Member]) -> int:
    """Records the members' workload managers delivered to their brokers as first seen that
    the Jobs stores already held (`supervisor.redundant` at `/v1/manager`), summed: counted
    since each agent started."""
    total = 0
    for member in members:
        status = await member.node.get("/v1/manager")
        total += int(status["supervisor"]["redundant"])
    return total


def _interleave(plan: list[tuple[Member, dict[str, Any]]], rng: random.Random) -> None:
    # Shuffle the events in place, keeping each job's in seq order: shuffle, then give each
    # job's positions back to its events in their order.
    by_job: dict[str, list[tuple[Member, dict[str, Any]]]] = {}
    for item in plan:
        by_job.setdefault(item[1]["id"], []).append(item)
    order = [item[1]["id"] for item in plan]
    rng.shuffle(order)
    taken = {wid: iter(events) for wid, events in by_job.items()}
    plan[:] = [next(taken[wid]) for wid in order]
