"""A member of a replica across members lost (issue 32): three members, a mock deployment
whose one replica spans two of them; the worker's member is killed with -9 (its agent:
the member becomes unreachable, its engine left behind). The head's member stops its part
and the replica is placed anew over the two members left -- whole, ready, answering -- and
never, meanwhile, with two replicas' parts ready at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.agent.deploy_harness import post
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import engine_ports

from .cluster import Member, fault_cluster, fault_rng, feature_on

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


async def parts(member: Member) -> list[dict[str, Any]]:
    return [r for r in await member.node.get("/v1/replicas") if r["deployment"] == "wide"]


async def whole_on(member: Member, alive: set[str]) -> list[dict[str, Any]] | None:
    """The replica's two parts, both ready, on members of `alive` -- as `member` sees it."""
    seen = [p for p in await parts(member) if p["nodeId"] in alive]
    if len(seen) != 2 or len({p["group"] for p in seen}) != 1:
        return None
    return seen if all(p["state"] == "ready" for p in seen) else None


async def test_the_workers_member_killed_places_the_replica_anew_on_those_left(
    tmp_path: Path,
) -> None:
    rng = fault_rng(3201)
    low, high = engine_ports()
    toml = f'[engines]\nport_range = "{low}-{high}"\n'
    async with fault_cluster(tmp_path, 3, rng, toml=toml) as members:
        await feature_on(members, "spanning-replicas")
        body = {"name": "wide", "engine": "mock", "source": "wide", "gpus": 0, "nodes": 2}
        status, text = await post(members[0].node, "/v1/deployments", body)
        assert status == 201, text
        everyone = {m.node_id for m in members}
        found: list[dict[str, Any]] = []

        async def formed() -> bool:
            nonlocal found
            found = await whole_on(members[0], everyone) or []
            return bool(found)

        await eventually(formed, "one replica over two members, ready", within_s=60)
        (worker,) = [p for p in found if p["layout"][0][0] != p["nodeId"]]
        lost = next(m for m in members if m.node_id == worker["nodeId"])
        left = [m for m in members if m is not lost]
        await lost.kill_agent()
        alive = {m.node_id for m in left}
        again: list[dict[str, Any]] = []

        async def placed_anew() -> bool:
            nonlocal again
            again = await whole_on(left[0], alive) or []
            return bool(again) and again[0]["group"] != worker["group"]

        await eventually(placed_anew, "the replica whole again on the members left", within_s=90)
        assert {p["nodeId"] for p in again} == alive
        url = f"http://127.0.0.1:{left[0].node.ports['facade']}/v1/chat/completions"
        ask = {"model": "wide", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session, session.post(url, json=ask) as answer:
            assert answer.status == 200, await answer.text()
