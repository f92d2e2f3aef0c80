"""An elastic deployment's decider killed during a scale-up (issue 30, "Done when"): three
members; requests wait at one member for a deployment at zero whose replica may only run
there; the member that decides the deployment's count scales it up and is killed with -9
at once. The version it signed stands: the next decider neither adds a replica while the
one starting comes up nor goes past max; one engine is started, not two; every request
is answered."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from facts.key_limits import holder_of
from tests.agent.deploy_harness import post
from tests.agent.harness import engine_pids
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import engine_ports

from .cluster import Member, fault_cluster, fault_rng, feature_on

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

NAME = "cold"


async def declared(member: Member) -> dict[str, Any]:
    (found,) = [d for d in await member.node.get("/v1/deployments") if d["name"] == NAME]
    return dict(found)


async def test_a_decider_killed_during_a_scale_up_leaves_one_replica_started_once(
    tmp_path: Path,
) -> None:
    rng = fault_rng(3001)
    low, high = engine_ports()
    toml = f'[engines]\nport_range = "{low}-{high}"\n'
    async with fault_cluster(tmp_path, 3, rng, toml=toml) as members:
        await feature_on(members, "elastic-deployments")
        decider_id = holder_of(NAME, [m.node_id for m in members])
        decider = next(m for m in members if m.node_id == decider_id)
        entry = rng.choice([m for m in members if m is not decider])  # runs the replica
        body = {
            "name": NAME, "engine": "mock", "source": NAME, "gpus": 0,
            "args": ["--startup-s", "2", "--latency-ms", "100"],
            "constraints": {"node": entry.node_id},
            "minReplicas": 0, "maxReplicas": 2, "idleToZeroS": 600, "scaleDownAfterS": 600,
        }  # fmt: skip
        status, text = await post(entry.node, "/v1/deployments", body)
        assert status == 201, text
        url = f"http://127.0.0.1:{entry.node.ports['facade']}/v1/chat/completions"
        ask = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

        async def one(session: aiohttp.ClientSession) -> int:
            async with session.post(url, json=ask) as response:
                await response.read()
                return response.status

        seen: list[int] = []

        async def scaled_up() -> bool:
            count = int((await declared(entry))["replicas"])
            seen.append(count)
            return count >= 1

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            asked = [asyncio.create_task(one(session)) for _ in range(12)]
            await eventually(scaled_up, "the decider scales the deployment up")
            await decider.kill_agent()  # -9, its version already signed and spread
            statuses = await asyncio.gather(*asked)
        assert statuses == [200] * 12
        after = await declared(entry)
        seen.append(int(after["replicas"]))
        assert max(seen) <= 2  # never past max
        assert after["replicas"] == 1  # the one starting took the burst: nothing more
        assert after["elastic"]["reason"] == "waiting"
        started = [pid for m in members for pid in engine_pids(m.node.home).values()]
        assert len(started) == 1, started  # one engine, started once
