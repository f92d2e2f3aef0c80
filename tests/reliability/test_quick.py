"""The quick tier of the fault harness: three members on 127.0.0.1 behind fault proxies, a
few hundred events, fixed seeds (`NVPAIR_FAULT_SEED` replays another), each scenario ending
with an exact comparison of every member's Jobs list against what the client was told."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng, manager_pid
from .ledger import RememberingClient
from .resources import sampling
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


async def accepted_at_least(client: RememberingClient, count: int, what: str) -> None:
    """Until the client has been told `count` events were accepted: faults start and end
    at points in the load, not at moments on a clock."""
    await eventually(lambda: client.figures.accepted >= count, what)


async def test_an_isolated_member_converges_after_heal(tmp_path: Path, tier: Tier) -> None:
    rng = fault_rng(1101)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random()), sized=tier.long) as client,
        sampling(members) as usage,
    ):
        cut = rng.choice(members)
        jobs = tier.pick(90, 3000)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(members, jobs=jobs, rate_per_s=tier.pick(60, 100), prefix="isolated")
            )
            await accepted_at_least(client, 20, "load under way")
            cut.isolate()
            await eventually(
                lambda: client.figures.accepted >= jobs, "load while isolated", within_s=120
            )
            # The control: the fault bit -- the isolated member lacks what the others took.
            behind = await client.divergences([cut])
            assert behind[0].missing or behind[0].older, f"{cut.name} missed nothing"
            cut.heal()
            healed = time.monotonic()
            await load
        assert all(p.counters.refused for p in cut.proxies.values()), cut.proxies
        await client.wait_converged(members, since=healed)
        print(client.figures.line(f"isolate {cut.name} under load, heal"))
        print(usage.line())
        assert client.figures.accepted == client.figures.events_sent
        assert client.figures.duplicates == 0


async def test_only_anti_entropy_repairs_a_member_whose_incoming_events_were_lost(
    tmp_path: Path, tier: Tier
) -> None:
    # Any failed send makes the sender retry the batch and catch up on its next success
    # (workload_manager/broadcaster.py), so a fault that lets a send succeed later is
    # repaired by catch-up. Here no send to the member succeeds until it has converged: its
    # manager port drops every connection from the first event on, while its node API
    # answers -- the only path left is anti-entropy over the node API. The long tier drops
    # it for over a minute of load and wants it repaired within 30 s of the load's end.
    rng = fault_rng(1102)
    async with (
        fault_cluster(tmp_path, 3, rng, anti_entropy_s=2.0) as members,
        RememberingClient(random.Random(rng.random()), sized=tier.long) as client,
        sampling(members) as usage,
    ):
        cut = rng.choice(members)
        manager_link = cut.proxies["manager"]
        manager_link.drop()
        manager_link.reset()
        through = manager_link.counters.accepted
        restarts = {m.name: await m.manager_restarts() for m in members}
        dropped = time.monotonic()
        await client.load(
            members, jobs=tier.pick(60, 1000), rate_per_s=tier.pick(60, 30), prefix="entropy"
        )
        dropped_for = time.monotonic() - dropped
        await client.wait_converged(members, within_s=30)
        # No batch and no catch-up reached it: not one connection got through, yet its
        # peers tried; and nobody restarted.
        assert manager_link.counters.accepted == through
        assert manager_link.counters.refused > 0
        assert {m.name: await m.manager_restarts() for m in members} == restarts
        assert await cut.node.metric("nvpair_anti_entropy_records_in_total") > 0
        print(
            client.figures.line(
                f"{cut.name}'s incoming events dropped for {dropped_for:.0f}s of load, "
                "anti-entropy alone (converged counted from the load's end)"
            )
        )
        print(usage.line())
        assert client.figures.duplicates == 0
        manager_link.heal()
        await client.wait_converged(members)  # the catch-up after heal changes nothing


async def test_managers_killed_under_load_lose_nothing(tmp_path: Path, tier: Tier) -> None:
    # The long tier kills a random manager or agent (restarting the agent) every few
    # seconds during about 10,000 events of every legal size.
    rng = fault_rng(1103)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random()), sized=tier.long) as client,
        sampling(members) as usage,
    ):
        kills: list[str] = []
        restarts = {m.name: 0 for m in members}

        async def kill_some(load: asyncio.Task[None]) -> None:
            while not load.done():
                victim = rng.choice(members)
                if tier.long and rng.random() < 0.3:
                    await client.before_kill([victim])
                    await victim.kill_agent()
                    kills.append(f"{victim.name} agent")
                    await victim.restart()
                    restarts[victim.name] = 0  # a new agent counts from nothing
                elif victim.signal_manager(signal.SIGKILL) is not None:
                    kills.append(f"{victim.name} manager")
                    restarts[victim.name] += 1
                    await wait_restarted(victim, restarts[victim.name])
                # The next kill comes a couple of seconds on: the faults' own pace.
                await asyncio.sleep(rng.uniform(1.0, tier.pick(2.0, 4.0)))

        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members,
                    jobs=tier.pick(150, 5000),
                    rate_per_s=tier.pick(50, 100),
                    prefix="killed",
                )
            )
            scenario.create_task(kill_some(load))
        assert len(kills) >= 2, kills
        ended = time.monotonic()
        await client.wait_converged(members, since=ended)
        print(client.figures.line(f"kill -9, {len(kills)} times: {', '.join(kills)}"))
        print(usage.line())
        assert client.figures.events_sent >= tier.pick(250, 9000)
        assert client.figures.duplicates == 0


async def test_an_agent_killed_under_load_and_restarted_loses_nothing(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1104)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random()), sized=tier.long) as client,
    ):
        victim = rng.choice(members)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members, jobs=tier.pick(60, 2000), rate_per_s=tier.pick(60, 100), prefix="agent"
                )
            )
            await accepted_at_least(client, 20, "load under way")
            before = victim.pid
            await client.before_kill([victim])
            await victim.kill_agent()
            # The control: its events are refused while it is down (the client tries again).
            await eventually(lambda: client.figures.retried > 0, f"{victim.name} refuses events")
            await victim.restart()
            restarted = time.monotonic()
            await load
        assert victim.pid != before
        await client.wait_converged(members, since=restarted)
        print(client.figures.line(f"kill -9 of agent {victim.name} under load, restart"))
        assert client.figures.duplicates == 0


async def wait_restarted(member: Member, restarts: int) -> None:
    """Until the supervisor has restarted `member`'s manager `restarts` times and it runs."""

    async def back() -> bool:
        # /v1/manager answers an error while no manager answers; its body says why.
        async with (
            aiohttp.ClientSession() as session,
            session.get(member.node.api + "/v1/manager", headers=member.node.owner) as response,
        ):
            if response.status != 200:
                return False
            supervisor = (await response.json())["supervisor"]
        return (
            supervisor["restarts"] >= restarts
            and supervisor["state"] == "running"
            and manager_pid(member.pid) is not None
        )

    await eventually(back, f"{member.name}'s manager restarted ({restarts})")
