"""Agents that run deployments, for the tests: a cluster whose members each have their own
engine ports (one host for every member), and the engines' processes as proc.json names
them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from netkit.processes import alive as alive
from tests.workload_manager.cluster_harness import engine_ports

from .harness import Node, engine_pids, eventually, kill_engines, make_node, start_cluster

__all__ = [
    "alive",
    "deployed",
    "engine_cluster",
    "engine_pids",
    "kill_engines",
    "post",
    "ready_everywhere",
    "replicas",
    "set_policy",
]


async def engine_cluster(
    root: Path,
    gpus: Mapping[str, str | None],
    extra_toml: str = "",
    agent_toml: str = "",
    *,
    one_range: bool = False,
    engines_toml: Mapping[str, str] | None = None,
) -> AsyncIterator[list[Node]]:
    """Started members named and with simulated GPUs as `gpus` says (`agent_toml`: more
    lines of every member's `[agent]` table); their engines killed at the end (agents
    leave engines running when they stop: the next start adopts them). With `one_range`
    every member has the same engine ports, as agents started on one host without their
    own `[engines] port_range` have; `engines_toml`: more lines of one member's `[engines]`
    table, by its name."""
    nodes = [make_node(root, name, spec) for name, spec in gpus.items()]
    shared = engine_ports()
    for node in nodes:
        node.home.mkdir(parents=True)
        # One host for every member: each its own engine ports unless `one_range` (on their
        # own hosts they would share the default range).
        low, high = shared if one_range else engine_ports()
        (node.home / "nvpair.toml").write_text(
            f"[agent]\nheartbeat_s = 0.5\n{agent_toml}"
            f'[engines]\nport_range = "{low}-{high}"\n'
            f"{(engines_toml or {}).get(node.name, '')}\n{extra_toml}"
        )
        (node.home / "nvpair.toml").chmod(0o600)  # API keys in it must be the owner's alone
    try:
        async for started in start_cluster(nodes):
            # Placement spreads replicas over the members a member knows when it places
            # them: a deployment made before b's record reached a lands on a alone (and
            # stays there: nothing moves a placed replica). Tests deploy into a formed cluster.
            await eventually(lambda: formed(nodes), "every member lists every member reachable")
            yield started
    finally:
        for node in nodes:
            kill_engines(node.home)


async def formed(nodes: list[Node]) -> bool:
    """Whether every member lists every member, each reachable."""
    for node in nodes:
        listed = await node.get("/v1/nodes")
        if len(listed) != len(nodes) or not all(n["reachable"] for n in listed):
            return False
    return True


async def post(node: Node, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(headers=node.owner) as session,
        session.post(node.api + path, json=body) as response,
    ):
        return response.status, await response.text()


async def deployed(nodes: list[Node], body: dict[str, Any], *, within_s: float = 60) -> None:
    """Deploy `body` through the first member and wait until every member sees all its
    replicas ready."""
    code, text = await post(nodes[0], "/v1/deployments", body)
    assert code == 201, text
    name, count = body["name"], body.get("replicas", 1)
    await eventually(
        lambda: ready_everywhere(nodes, name, count),
        f"{count} ready replicas of {name} in every member's view",
        within_s=within_s,
    )


async def set_policy(nodes: list[Node], policy: str) -> None:
    """Every member routes a deployment's requests by `policy` (`nvpair routing --policy`)."""
    for node in nodes:
        code, out, err = await node.cli("routing", "--policy", policy)
        assert code == 0, err
        assert f"policy: {policy}" in out


async def replicas(node: Node, deployment: str) -> list[dict[str, Any]]:
    return [r for r in await node.get("/v1/replicas") if r["deployment"] == deployment]


async def ready_everywhere(nodes: list[Node], deployment: str, count: int) -> bool:
    """Every member lists `count` ready replicas of `deployment` and (with any) holds the
    deployment itself: a replica's record can reach a member before the deployment does
    (the record comes from the member running it, the deployment from the one it was
    declared on), and a member serves, counts and explains by the deployment."""
    for node in nodes:
        seen = await replicas(node, deployment)
        if len(seen) != count or any(r["state"] != "ready" for r in seen):
            return False
        if count and deployment not in {d["name"] for d in await node.get("/v1/deployments")}:
            return False
    return True
