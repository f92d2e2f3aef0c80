"""A bad network between members: one member partitioned both ways under load, one link cut
one way, and flapping links (loss, jitter, cut connections). Each ends with an exact
comparison of every member's Jobs list against what the client was told."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng, heal_partition, partition, settle
from .ledger import RememberingClient
from .resources import sampling
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


async def test_a_member_partitioned_both_ways_under_load_converges_after_heal(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1301)
    cut_s = tier.pick(5.0, 30.0)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
        sampling(members) as usage,
    ):
        victim = rng.choice(members)
        others = [m for m in members if m is not victim]
        rate = tier.pick(40, 60)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members,
                    jobs=int(rate * (cut_s + 6) / 2),  # about two events a job
                    rate_per_s=rate,
                    prefix="partition",
                )
            )
            await eventually(lambda: client.figures.accepted >= 20, "load under way")
            partition(victim, members)
            at_cut = client.figures.accepted
            await settle(cut_s)  # the partition's length
            # The controls: the load went on, the victim lacks what the others took, and
            # its own calls out were refused at the others' proxies.
            assert client.figures.accepted > at_cut + 10
            behind = await client.divergences([victim])
            assert behind[0].missing or behind[0].older, f"{victim.name} missed nothing"
            assert all(p.counters.refused for o in others for p in o.proxies.values())
            heal_partition(victim, members)
            healed = time.monotonic()
            await load
        await client.wait_converged(members, since=healed)
        print(client.figures.line(f"{victim.name} partitioned both ways for {cut_s:.0f}s"))
        print(usage.line())
        assert client.figures.duplicates == 0


async def test_a_link_cut_one_way_is_bridged_by_the_other_members(
    tmp_path: Path, tier: Tier
) -> None:
    # a cannot reach b (every other path works): a's events still reach b through c's
    # relay and anti-entropy, and the members converge while the cut holds.
    rng = fault_rng(1302)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
    ):
        sender, receiver, _ = rng.sample(members, 3)
        receiver.cut_from(sender)
        refused = sum(p.counters.refused for p in receiver.proxies.values())
        cut = time.monotonic()
        await client.load(
            members, jobs=tier.pick(60, 2000), rate_per_s=tier.pick(60, 100), prefix="oneway"
        )
        await client.wait_converged(members, since=cut)
        # The control: the cut bit -- the sender's calls to the receiver were refused.
        assert sum(p.counters.refused for p in receiver.proxies.values()) > refused
        print(
            client.figures.line(
                f"{sender.name} -> {receiver.name} cut one way, converged with the cut held"
            )
        )
        receiver.heal_from(sender)
        assert client.figures.duplicates == 0


async def test_flapping_links_with_loss_and_jitter_lose_nothing(tmp_path: Path, tier: Tier) -> None:
    # Every link into every member: 20 % of chunks lost (each arrives after its
    # retransmission), 0-400 ms of delay (200 ms of jitter each way around 200 ms), and
    # every connection into one member or another cut every 1-3 s. The members must
    # converge while it goes on.
    rng = fault_rng(1303)
    async with (
        fault_cluster(tmp_path, 3, rng) as members,
        RememberingClient(random.Random(rng.random())) as client,
        sampling(members) as usage,
    ):
        for member in members:
            for proxy in member.proxies.values():
                proxy.lose(0.2)
                proxy.delay(200, jitter_ms=200)
        resets = 0

        async def flap(until: asyncio.Event) -> None:
            nonlocal resets
            while not until.is_set():
                await settle(rng.uniform(1.0, 3.0))  # the flapping's own pace
                victim: Member = rng.choice(members)
                for proxy in victim.proxies.values():
                    proxy.reset()
                resets += 1

        done = asyncio.Event()
        flapping = asyncio.create_task(flap(done))
        try:
            start = time.monotonic()
            await client.load(
                members, jobs=tier.pick(60, 2000), rate_per_s=tier.pick(40, 60), prefix="flap"
            )
            await client.wait_converged(members, since=start, within_s=tier.pick(45, 120))
        finally:
            done.set()
            await flapping
        lost = sum(p.counters.chunks_lost for m in members for p in m.proxies.values())
        assert lost > 0, "no chunk was lost"  # the control: the faults bit
        assert resets > 0
        print(
            client.figures.line(
                f"flapping links (20% loss, 200+-200 ms, {resets} cuts, {lost} chunks lost)"
            )
        )
        print(usage.line())
        assert client.figures.duplicates == 0
