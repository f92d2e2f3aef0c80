"""Issue 18's membership at 16 agents (simulated GPUs): the cluster forms and every member
lists all 16 reachable within 10 s of the last join, and one agent killed (kill -9) is
listed unreachable by every other member within 10 s while the other 15 stay reachable.
The 10 s are the issue's own bound, so an absolute `within_s` is right here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import pytest

from tests.agent.harness import Node, make_node, start_cluster
from tests.fixtures.waiting import eventually

from .cluster import manager_pid, process_gone

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

SIZE = 16
WITHIN_S = 10.0


async def _views(nodes: list[Node]) -> list[dict[str, bool]]:
    listed = await asyncio.gather(*(n.get("/v1/nodes") for n in nodes))
    return [{n["nodeId"]: n["reachable"] for n in nodes_seen} for nodes_seen in listed]


async def test_sixteen_agents_list_each_other_and_a_killed_one_goes_unreachable(
    tmp_path: Path,
) -> None:
    nodes = [make_node(tmp_path, f"m{i:02d}", "l4:1") for i in range(SIZE)]
    generator = cast(AsyncGenerator[list[Node], None], start_cluster(nodes))
    async with contextlib.aclosing(generator) as started:
        async for _ in started:
            await _scenario(nodes)  # the last join is done: the clock starts


async def _scenario(nodes: list[Node]) -> None:
    ids = [await n.node_id() for n in nodes]

    async def all_list_all() -> bool:
        views = await _views(nodes)
        return all(set(v) == set(ids) and all(v.values()) for v in views)

    formed = time.monotonic()
    await eventually(all_list_all, f"every member lists {SIZE} reachable", within_s=WITHIN_S)
    print(f"all list {SIZE} reachable {time.monotonic() - formed:.1f} s after the last join")

    victim, rest = nodes[5], [n for i, n in enumerate(nodes) if i != 5]
    victim_id = ids[5]
    assert victim.proc is not None
    child = manager_pid(victim.proc.pid)
    victim.proc.kill()
    await victim.proc.wait()
    killed = time.monotonic()

    async def all_see_it_gone() -> bool:
        views = await _views(rest)
        # The control: the other 15 stay reachable everywhere meanwhile.
        assert all(all(r for n, r in v.items() if n != victim_id) for v in views), views
        return all(not v[victim_id] for v in views)

    await eventually(
        all_see_it_gone, "every member lists the killed one unreachable", within_s=WITHIN_S
    )
    print(f"the killed member unreachable everywhere {time.monotonic() - killed:.1f} s after")
    if child is not None:
        await eventually(lambda: process_gone(child), "its orphaned manager exits")
