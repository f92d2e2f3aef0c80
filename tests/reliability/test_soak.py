"""The soak (issue 11, item 6): a steady load on every member for a set time, every agent's
and manager's memory and descriptors and every member's queues sampled and printed, and
all of them flat -- no backlog grows, nothing trends up -- then the exact comparison of
every member's Jobs list against what the client was told.

Flat means, per series, the mean of the last third of the samples taken under load against
the mean of the first third (after a warm-up), with a generous bound: never an absolute
time. The queues must also drain once the load stops.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Final

import aiohttp
import pytest

from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng
from .ledger import RememberingClient
from .resources import Usage, sampling
from .steady import Depths, depth_sampling, read_depths, steady_load, thirds
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

WARM_UP: Final = 0.2  # of the load's samples: starting up, caches filling
MEMORY_FACTOR: Final = 1.25  # the last third's memory at most this much of the first's ...
MEMORY_SLACK_MIB: Final = 16.0  # ... plus this ...
# ... plus this much per job entered: what a member holds per job (the manager's relay keeps
# every live record, SQLite's cache fills) is state, not a leak.
MEMORY_PER_JOB_KIB: Final = 4.0
FDS_SLACK: Final = 10  # the last third's mean descriptors at most this many above the first's
QUEUE_FACTOR: Final = 2.0  # the last third's mean depth at most twice the first's ...
QUEUE_SLACK_S: Final = 0.5  # ... plus this long's worth of the load's events


async def test_a_steady_load_leaves_nothing_growing(tmp_path: Path, tier: Tier) -> None:
    rng = fault_rng(1501)
    size = tier.pick(3, 5)
    rate = tier.pick(100.0, 1000.0)
    duration_s = tier.pick(20.0, 300.0)
    async with (
        fault_cluster(tmp_path, size, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
        sampling(members) as usage,
        depth_sampling(members) as depths,
    ):
        loop = asyncio.get_running_loop()
        began = loop.time()
        rates = await steady_load(
            client,
            members,
            random.Random(rng.random()),
            rate_per_s=rate,
            duration_s=duration_s,
            posters=tier.pick(16, 100),  # 100: the client session's connection limit,
            prefix="soak",
        )
        ended, stopped = loop.time(), time.monotonic()
        # After the load every queue drains: nothing waits for a peer or for the store.
        await eventually(lambda: _drained(members), "every member's queues drain", within_s=60)
        drained_s = time.monotonic() - stopped
        await client.wait_converged(members, since=stopped, within_s=tier.pick(30, 120))
        repairs = [await _repair_counts(m) for m in members]
    print(rates.line())
    print(client.figures.line(f"soak, {size} members"))
    print(f"queues drained {drained_s:.1f}s after the load")
    print("anti-entropy records taken / redundant deliveries per member: " + ", ".join(repairs))
    warm = began + WARM_UP * (ended - began)
    # A steady load enters jobs at a steady pace: the thirds' middles are 2/3 of the window
    # apart, so about this many jobs were entered between them.
    between = client.figures.jobs * (1 - WARM_UP) * 2 / 3
    lines = _resource_lines(usage, warm, ended, between) + _depth_lines(depths, began, ended)
    for line in lines:
        print(line)
    # The control: the load went through (most of what was offered was acknowledged).
    assert rates.accepted >= 0.5 * rate * duration_s, rates.line()
    _check_resources(usage, warm, ended, client.figures.jobs)
    _check_depths(depths, began, ended, rate)
    assert client.figures.duplicates == 0


async def _drained(members: list[Member]) -> bool:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        for member in members:
            got = await read_depths(session, member, loop.time())
            if got.broadcast or got.writer:
                return False
    return True


async def _repair_counts(member: Member) -> str:
    # What anti-entropy repaired on this member, and what its relay delivered that the
    # store already held (a repair that raced the broadcast shows as both).
    taken = await member.node.metric("nvpair_anti_entropy_records_in_total")
    redundant = await member.node.metric("nvpair_relay_redundant_deliveries_total")
    return f"{member.name} {taken:.0f}/{redundant:.0f}"


def _window(usage: Usage, start: float, end: float) -> dict[str, tuple[list[int], list[int]]]:
    # Per process: its RSS (KiB) and descriptor samples taken between start and end.
    found = {}
    for name, got in sorted(usage.samples.items()):
        inside = [s for s in got if start <= s.at <= end]
        found[name] = ([s.rss_kib for s in inside], [s.fds for s in inside])
    return found


def _resource_lines(usage: Usage, start: float, end: float, jobs_between: float) -> list[str]:
    lines = []
    for name, (rss, fds) in _window(usage, start, end).items():
        first_kib, last_kib = thirds(rss)
        per_job = (last_kib - first_kib) / max(jobs_between, 1)
        first_fds, last_fds = thirds(fds)
        lines.append(
            f"{name}: RSS {first_kib / 1024:.1f} -> {last_kib / 1024:.1f} MiB (first third -> "
            f"last, {per_job:.2f} KiB per job entered, peak {max(rss) / 1024:.1f}), "
            f"fds {first_fds:.1f} -> {last_fds:.1f} (peak {max(fds)}), {len(rss)} samples"
        )
    return lines


def _check_resources(usage: Usage, start: float, end: float, jobs: int) -> None:
    for name, (rss, fds) in _window(usage, start, end).items():
        first_kib, last_kib = thirds(rss)
        bound = first_kib * MEMORY_FACTOR + MEMORY_SLACK_MIB * 1024 + MEMORY_PER_JOB_KIB * jobs
        assert last_kib <= bound, f"{name}'s memory grows: {first_kib:.0f} -> {last_kib:.0f} KiB"
        first_fds, last_fds = thirds(fds)
        assert last_fds <= first_fds + FDS_SLACK, f"{name}'s fds grow: {first_fds} -> {last_fds}"


def _depth_lines(depths: Depths, start: float, end: float) -> list[str]:
    lines = []
    for name, got in sorted(depths.between(start, end).items()):
        broadcast = [s.broadcast for s in got]
        writer = [s.writer for s in got]
        b_first, b_last = thirds(broadcast)
        w_first, w_last = thirds(writer)
        lines.append(
            f"{name} queues: broadcast {b_first:.1f} -> {b_last:.1f} (max {max(broadcast)}), "
            f"jobs writer {w_first:.1f} -> {w_last:.1f} (max {max(writer)}), supervisor "
            f"dropped {got[0].dropped} -> {got[-1].dropped}, {len(got)} samples"
        )
    return lines


def _check_depths(depths: Depths, start: float, end: float, rate: float) -> None:
    slack = QUEUE_SLACK_S * rate
    for name, got in depths.between(start, end).items():
        for what, series in (
            ("broadcast queue", [s.broadcast for s in got]),
            ("jobs writer's pending rows", [s.writer for s in got]),
        ):
            first, last = thirds(series)
            assert last <= QUEUE_FACTOR * first + slack, f"{name}'s {what} grows: {series}"
        # The control: the reads are live -- every member's writer held rows at some sample.
        assert max(s.writer for s in got) > 0, f"{name}'s Jobs writer never seen busy"
        dropped = [s.dropped for s in got]
        assert dropped[-1] == dropped[0], f"{name}'s supervisor dropped frames: {dropped}"
