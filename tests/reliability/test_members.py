"""Membership changing under load: a member removed while the others take events, and a
member joining while they do. Each ends with an exact comparison of the members' Jobs lists
against what the client was told."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp
import pytest

from tests.agent.harness import job_key
from tests.fixtures.records import lifecycle_event, workload_record
from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng, joined
from .ledger import RememberingClient, list_jobs
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


async def test_a_member_removed_under_load_leaves_the_others_whole(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1401)
    async with (
        fault_cluster(tmp_path, 4, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
    ):
        victim = rng.choice(members[1:])  # the first member admits; any other may go
        rest = [m for m in members if m is not victim]
        # Before: the victim is a member like any other, its jobs reach everyone.
        await client.load(members, jobs=tier.pick(30, 500), rate_per_s=60, prefix="before")
        await client.wait_converged(members)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(rest, jobs=tier.pick(60, 2000), rate_per_s=60, prefix="during")
            )
            await eventually(lambda: client.figures.accepted >= 100, "load under way")
            code, _, err = await rest[0].node.cli("cluster", "remove", victim.node_id)
            assert code == 0, err
            removed = time.monotonic()
            await eventually(lambda: _all_unpinned(rest, victim), "every member unpins it")
            await load
        # The control pair: an event the removed member takes reaches nobody, while one
        # entered at a member at the same time reaches every member.
        ghost = workload_record("ghost", 1, origin=victim.node_id, run="after")
        kept = workload_record("kept", 1, origin=rest[0].node_id, run="after")
        await _post(victim, ghost)
        assert await client.enter(rest[0], kept)
        await client.wait_converged(rest, since=removed)
        for member in rest:
            async with aiohttp.ClientSession() as session:
                assert job_key(ghost) not in await list_jobs(session, member)
        print(client.figures.line(f"{victim.name} removed under load"))
        assert client.figures.duplicates == 0


async def test_a_member_joining_under_load_gets_the_whole_list(tmp_path: Path, tier: Tier) -> None:
    rng = fault_rng(1402)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
    ):
        founders = list(members)
        jobs = tier.pick(120, 3000)
        joined_at: list[float] = []  # set once the newcomer runs

        async def keep_loading() -> None:
            # Batches until the newcomer runs and `jobs` were entered, then one batch more:
            # however long the join takes, the load goes on through it and after it.
            batch = entered = 0
            while True:
                last = bool(joined_at) and entered >= jobs
                size = min(30, jobs)
                await client.load(founders, jobs=size, rate_per_s=60, prefix=f"joining{batch}")
                batch, entered = batch + 1, entered + size
                if last:
                    return

        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(keep_loading())
            await eventually(lambda: client.figures.accepted >= 60, "load under way")
            async with joined(tmp_path, members, random.Random(rng.random())) as newcomer:
                started = time.monotonic()
                at_join = client.figures.accepted
                joined_at.append(started)
                await load
                # The load went on while it joined, and it takes events of its own.
                assert client.figures.accepted > at_join
                own = workload_record("newcomer", 1, origin=newcomer.node_id, run="joined")
                assert await client.enter(newcomer, own)
                await client.wait_converged(members, since=started)
                print(client.figures.line(f"{newcomer.name} joined under load"))
        assert client.figures.duplicates == 0


async def _all_unpinned(members: list[Member], gone: Member) -> bool:
    for member in members:
        pins = {m["nodeId"]: m for m in await member.node.get("/v1/members")}
        if gone.node_id in pins and not pins[gone.node_id]["removed"]:
            return False
    return True


async def _post(member: Member, record: dict[str, object]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            member.node.api + "/v1/jobs/events",
            json=lifecycle_event(record),
            headers=member.node.owner,
        ) as r,
    ):
        assert r.status == 202, await r.text()
