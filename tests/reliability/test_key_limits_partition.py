"""An API key's limits through a partition (issue 29, item 4; docs/inference.md, "API
keys"): three members, a key with `--rpm 60`, one member that does not hold the key's
count cut off both ways. The cut-off member admits its share alone -- 20 of 60 -- and says
so (`nvpair_key_limit_alone`, the 429's words); the two members on the large side go on
with the whole limit between them; healed, the cut-off member stops admitting alone."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from facts.key_limits import holder_of
from tests.agent.cluster.test_api_keys import known_everywhere
from tests.agent.harness import start_engine
from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng, feature_on, heal_partition, partition

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

BODY: Any = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def send(member: Member, secret: str, count: int) -> list[tuple[int, str]]:
    url = f"http://127.0.0.1:{member.node.ports['facade']}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {secret}"}
    gate = asyncio.Semaphore(8)
    async with aiohttp.ClientSession(headers=headers) as session:

        async def one() -> tuple[int, str]:
            async with gate, session.post(url, json=BODY) as response:
                return response.status, await response.text()

        return await asyncio.gather(*(one() for _ in range(count)))


async def test_a_cut_off_member_admits_its_share_alone_and_says_so(tmp_path: Path) -> None:
    engine = await start_engine("m1")
    try:
        # The default heartbeat (2 s: a ping waits 1 s). At 0.5 s a ping waits 0.25 s, and
        # on a loaded machine a large-side member counted its holder out for a moment and,
        # reaching no more than half of the members, admitted its share alone as well.
        toml = f'engines = ["vllm={engine.url}"]\n'
        async with fault_cluster(tmp_path, 3, fault_rng(2901), toml=toml) as members:
            await feature_on(members, "cluster-key-limits")  # keys counted at holders
            code, out, err = await members[0].node.cli("keys", "create", "batch", "--rpm", "60")
            assert code == 0, err
            secret = out.splitlines()[0]

            # Taken with the key and refused without it: a member that has heard of no key
            # yet serves everyone, so a 200 alone says nothing.
            await known_everywhere([m.node for m in members], secret)
            holder = holder_of("batch", [m.node_id for m in members])
            victim = random.Random(2901).choice([m for m in members if m.node_id != holder])
            others = [m for m in members if m is not victim]
            assert await victim.node.metric("nvpair_key_limit_alone") == 0  # the control

            partition(victim, members)
            try:
                alone = await send(victim, secret, 60)
                # Admitted: answered, or failed for a member it routed to and cannot reach
                # (502: the limit counts what it let in, not what the engines answered).
                refused = [text for status, text in alone if status == 429]
                print(f"cut off: {60 - len(refused)} of 60 admitted")
                assert len(refused) == 40, alone[:3]  # 60 over the three members it knows
                assert all("20 on this member" in text for text in refused), refused[:1]
                assert await victim.node.metric("nvpair_key_limit_alone") == 1
                # The large side: the whole limit between its two members.
                large = await send(others[0], secret, 50) + await send(others[1], secret, 50)
                on_large = sum(1 for status, _ in large if status != 429)
                print(f"large side: {on_large} of 100 admitted")
                assert 50 <= on_large <= 60
            finally:
                heal_partition(victim, members)

            async def not_alone() -> bool:
                await send(victim, secret, 1)  # it asks again as requests come
                return await victim.node.metric("nvpair_key_limit_alone") == 0

            await eventually(not_alone, "the healed member stops admitting alone")
    finally:
        await engine.stop()
