"""What the soak needs besides the cluster: a steady load for a set time, a sampler of every
member's queue depths, and the comparison of a series' last third with its first.

The load goes through `RememberingClient.enter`, so only a 202 is remembered, as in every
other scenario; it is paced by a schedule (the k-th event at start + k / rate) shared by
many concurrent posters, so a slow answer holds up one poster, not the rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.records import workload_record

from .cluster import Member
from .ledger import RememberingClient

__all__ = ["Depths", "LoadRates", "depth_sampling", "steady_load", "thirds"]

DEPTH_INTERVAL_S: Final = 1.0


@dataclass
class LoadRates:
    """What a steady load offered and what it achieved."""

    offered_per_s: float
    posters: int
    elapsed_s: float = 0.0
    sent: int = 0  # events posted (first tries)
    accepted: int = 0  # of those, answered 202 (after retries, if any)
    late: int = 0  # events posted more than 0.5 s after their slot: the client fell behind

    def line(self) -> str:
        took = max(self.elapsed_s, 1e-9)
        return (
            f"load: offered {self.offered_per_s:.0f} events/s by {self.posters} posters for "
            f"{self.elapsed_s:.1f}s; achieved {self.sent / took:.0f} events/s sent, "
            f"{self.accepted / took:.0f}/s acknowledged ({self.sent} sent, {self.accepted} "
            f"acknowledged, {self.late} posted over 0.5 s late)"
        )


async def steady_load(
    client: RememberingClient,
    members: Sequence[Member],
    rng: random.Random,  # each job's last state
    *,
    rate_per_s: float,
    duration_s: float,
    posters: int,
    prefix: str,
) -> LoadRates:
    """Enter jobs at every member in turn for `duration_s`, each taken to a random last state one
    seq at a time, at about `rate_per_s` events a second in all; a job whose event is never
    acknowledged gets no later ones. Returns the offered and achieved rates."""
    rates = LoadRates(rate_per_s, posters)
    sent0, accepted0 = client.figures.events_sent, client.figures.accepted
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + duration_s
    slots = itertools.count()
    jobs = itertools.count()
    now_ms = int(time.time() * 1000)

    async def poster(origin: Member) -> None:
        while loop.time() < end:
            n = next(jobs)
            for seq in range(1, rng.randint(1, 3) + 1):
                due = start + next(slots) / rate_per_s
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # the load's pace: the slot's time
                elif delay < -0.5:
                    rates.late += 1
                if loop.time() >= end:
                    return
                record = workload_record(
                    f"{prefix}-{n}", seq, origin=origin.node_id, run=f"{prefix}-run",
                    created_at=now_ms,
                )  # fmt: skip
                if seq == 1:
                    client.figures.jobs += 1
                if not await client.enter(origin, record):
                    break

    async with asyncio.TaskGroup() as group:
        # Each poster posts to one member (the origin of all its jobs): the client's pool then
        # holds at most posters / members connections to each, from the first seconds on. Had
        # every poster picked an origin per job, the pool would keep each member's high-water
        # mark of requests in flight, which creeps up for minutes (an idle keep-alive
        # connection is not counted against the pool's limit) and reads as a descriptor leak.
        for n in range(posters):
            group.create_task(poster(members[n % len(members)]))
    rates.elapsed_s = loop.time() - start
    rates.sent = client.figures.events_sent - sent0
    rates.accepted = client.figures.accepted - accepted0
    return rates


@dataclass(frozen=True)
class DepthSample:
    """One member's queues at one moment."""

    at: float  # loop time
    broadcast: int  # events waiting for any peer (`nvpair_broadcast_queue_depth`, summed)
    writer: int  # rows handed to the Jobs writer, not committed (`nvpair_jobs_writer_pending`)
    dropped: int  # frames the supervisor could not hand to the manager (`/v1/manager`)


@dataclass
class Depths:
    """Every member's queue samples, by member name."""

    samples: dict[str, list[DepthSample]] = field(default_factory=dict)

    def between(self, start: float, end: float) -> dict[str, list[DepthSample]]:
        return {
            name: [s for s in got if start <= s.at <= end] for name, got in self.samples.items()
        }


async def read_depths(session: aiohttp.ClientSession, member: Member, at: float) -> DepthSample:
    """The member's queue depths now, from its /metrics and /v1/manager."""
    async with session.get(member.node.api + "/metrics") as response:
        text = await response.text()
    broadcast = writer = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nvpair_broadcast_queue_depth":
                broadcast += int(sample.value)
            elif sample.name == "nvpair_jobs_writer_pending":
                writer = int(sample.value)
    async with session.get(member.node.api + "/v1/manager", headers=member.node.owner) as response:
        status: dict[str, Any] = await response.json()
    return DepthSample(at, broadcast, writer, int(status["supervisor"]["dropped"]))


@contextlib.asynccontextmanager
async def depth_sampling(
    members: Sequence[Member], interval_s: float = DEPTH_INTERVAL_S
) -> AsyncIterator[Depths]:
    """Sample every member's queue depths every `interval_s` while the block runs."""
    depths = Depths()
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=10)

    async def run(session: aiohttp.ClientSession) -> None:
        while True:
            for member in members:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    got = await read_depths(session, member, loop.time())
                    depths.samples.setdefault(member.name, []).append(got)
            await asyncio.sleep(interval_s)  # the sampling period, not a wait for a result

    async with aiohttp.ClientSession(timeout=timeout) as session:
        task = asyncio.create_task(run(session))
        try:
            yield depths
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def thirds(values: Sequence[float]) -> tuple[float, float]:
    """The mean of a series' first third and of its last third (at least 3 values)."""
    if len(values) < 3:
        raise ValueError(f"a trend needs at least 3 samples, not {len(values)}")
    third = len(values) // 3
    return statistics.fmean(values[:third]), statistics.fmean(values[-third:])
