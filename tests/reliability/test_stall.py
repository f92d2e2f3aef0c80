"""Stalls and crashes of whole members: a workload manager stopped (SIGSTOP) under load, an
agent stopped for a long while, and every member killed at once right after an
acknowledgement, then restarted. Each ends with an exact comparison of every member's Jobs
list against what the client was told."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.fixtures.records import workload_record
from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng, manager_pid, settle
from .ledger import RememberingClient, list_jobs
from .resources import sampling
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


async def health(member: Member) -> tuple[int, dict[str, object]]:
    """The member's /healthz: its status and body."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(member.node.api + "/healthz") as response,
    ):
        return response.status, await response.json()


async def test_a_stalled_manager_is_noticed_restarted_and_loses_nothing(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1201)
    stalls = tier.pick(1, 5)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
        sampling(members) as usage,
    ):
        jobs = tier.pick(80, 2000)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(members, jobs=jobs, rate_per_s=tier.pick(60, 100), prefix="stall")
            )
            for n in range(stalls):
                await eventually(
                    lambda n=n: client.figures.accepted >= (n + 1) * jobs // (stalls + 2),
                    "load under way",
                    within_s=120,
                )
                victim = rng.choice(members)
                restarts = await victim.manager_restarts()
                stopped = victim.signal_manager(signal.SIGSTOP)
                assert stopped is not None, f"{victim.name} has no manager to stop"
                # The control: the stall is seen -- /healthz says not ok while it is hung --
                # and the hung manager is killed and replaced by the supervisor.
                await eventually(
                    lambda v=victim: _not_ok(v), f"{victim.name}'s /healthz reports the hang"
                )
                await eventually(
                    lambda v=victim, p=stopped: manager_pid(v.pid) not in (None, p),
                    f"{victim.name}'s hung manager replaced",
                )
                await eventually(lambda v=victim: _ok(v), f"{victim.name} healthy again")
                assert await victim.manager_restarts() > restarts
            settled = time.monotonic()
            await load
        await client.wait_converged(members, since=settled)
        print(client.figures.line(f"a manager stopped (SIGSTOP) under load, {stalls} times"))
        print(usage.line())
        assert client.figures.duplicates == 0


async def test_an_agent_stopped_for_a_long_while_catches_up(tmp_path: Path, tier: Tier) -> None:
    # The whole member stalls (SIGSTOP of the agent: a frozen VM, a swapping machine): its
    # peers cannot reach its node API, its broker reads nothing from its manager, the
    # client's requests at it wait. After SIGCONT it must catch up and lose nothing.
    rng = fault_rng(1202)
    stall_s = tier.pick(6.0, 120.0)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
        sampling(members) as usage,
    ):
        victim = rng.choice(members)
        others = [m for m in members if m is not victim]
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members,
                    jobs=tier.pick(80, 3000),
                    rate_per_s=tier.pick(40, 40),
                    prefix="frozen",
                )
            )
            await eventually(lambda: client.figures.accepted >= 20, "load under way")
            victim.signal_agent(signal.SIGSTOP)
            try:
                # The control: the others keep taking events while it is stopped (the load's
                # posters soon all wait on the stopped member; these go past them).
                for other in others:
                    control = workload_record(
                        f"control-{other.name}", 1, origin=other.node_id, run="frozen-run"
                    )
                    assert await client.enter(other, control), f"{other.name} refused"
                await settle(stall_s)  # the stall's length
                # The fault bit: the stopped member's local API does not answer.
                assert not await _answers(victim), f"{victim.name} answered while stopped"
            finally:
                victim.signal_agent(signal.SIGCONT)
            resumed = time.monotonic()
            await load
        await client.wait_converged(members, since=resumed, within_s=60)
        assert all([await _ok(m) for m in others])
        print(client.figures.line(f"agent {victim.name} stopped for {stall_s:.0f}s under load"))
        print(usage.line())
        assert client.figures.duplicates == 0


async def test_every_member_killed_at_once_right_after_an_ack_loses_nothing(
    tmp_path: Path, tier: Tier
) -> None:
    # A 202 means the event is in its origin's store: kill -9 of every member a moment
    # after one, and a restart of all of them, must keep every acknowledged event.
    rng = fault_rng(1203)
    rounds = tier.pick(1, 4)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
    ):
        jobs = tier.pick(80, 2000)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(members, jobs=jobs, rate_per_s=tier.pick(60, 100), prefix="blackout")
            )
            for n in range(rounds):
                goal = (n + 1) * jobs // (rounds + 1)
                await eventually(
                    lambda goal=goal: client.figures.accepted >= goal,
                    "load under way",
                    within_s=120,
                )
                told = dict(client.acked)
                await client.before_kill(members)
                await asyncio.gather(*(m.kill_agent() for m in members))
                # What was acknowledged up to the kill must come back after it.
                await asyncio.gather(*(m.restart() for m in members))
                for member in members:
                    listed = await _listed(member)
                    lost = [k for k, seq in told.items() if listed.get(k, 0) < seq]
                    origin_lost = [k for k in lost if k[0] == member.node_id]
                    # Its own acknowledged events are in its store the moment it is back.
                    assert not origin_lost, f"{member.name} lost its own {origin_lost[:3]}"
            restarted = time.monotonic()
            await load
        await client.wait_converged(members, since=restarted)
        print(client.figures.line(f"every member killed at once, {rounds} times, restarted"))
        assert client.figures.duplicates == 0


async def _listed(member: Member) -> dict[tuple[str, str, str], int]:
    async with aiohttp.ClientSession() as session:
        return await list_jobs(session, member)


async def _answers(member: Member) -> bool:
    try:
        async with asyncio.timeout(1.0):
            await health(member)
    except TimeoutError:
        return False
    return True


async def _not_ok(member: Member) -> bool:
    status, _ = await health(member)
    return status == 503


async def _ok(member: Member) -> bool:
    status, _ = await health(member)
    return status == 200
