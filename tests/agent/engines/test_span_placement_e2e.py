"""Replicas across members placed on real agents with simulated GPUs (issue 32): two
members of 8 H100s and one with 2 free -- an SGLang deployment of 2 x 4 GPUs per replica
lands on the two with room, 4 GPUs on each, never on the one with 2; a third replica that
fits nowhere is explained; SGLang's parts talk NCCL over the network, so a member that has
not said the network is trusted refuses the deployment, and its parts placed on such
members hold their GPUs and wait, saying why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from agent.engines.parts import UNTRUSTED

from ..deploy_harness import engine_cluster, post, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("span-placement")
    gpus = {"a": "h100-80gb-sxm:8", "b": "h100-80gb-sxm:8", "c": "h100-80gb-sxm:8"}
    # c alone says its network is trusted: the deployment is declared there (a member that
    # does not say so refuses it), and its parts, placed on a and b, wait.
    trusted = {"c": "trusted_network = true"}
    async for started in engine_cluster(root, gpus, engines_toml=trusted):
        yield started


async def parts_of(node: Node, name: str, count: int) -> list[dict[str, Any]] | None:
    seen = await replicas(node, name)
    return seen if len(seen) == count else None


async def has(node: Node, name: str, count: int) -> bool:
    return await parts_of(node, name, count) is not None


async def test_two_by_four_lands_on_the_members_with_room_never_on_one_with_two(
    trio: list[Node],
) -> None:
    a, b, c = trio
    c_id = await c.node_id()
    # c keeps 6 of its 8 GPUs busy: 2 free there.
    busy = {
        "name": "busy",
        "engine": "mock",
        "source": "busy",
        "gpus": 6,
        "constraints": {"node": "c"},
    }
    status, made = await post(a, "/v1/deployments", busy)
    assert status == 201, made
    await eventually(lambda: has(a, "busy", 1), "c's busy replica in a's view")
    wide = {
        "name": "big", "engine": "sglang", "source": "/models/big", "gpus": 4, "nodes": 2,
        "replicas": 2, "constraints": {"oneDomain": True},
    }  # fmt: skip
    status, made = await post(a, "/v1/deployments", wide)
    assert status == 400, made  # a does not say the network is trusted
    assert "trusted_network" in made
    status, made = await post(c, "/v1/deployments", wide)
    assert status == 201, made
    found: list[dict[str, Any]] = []

    async def placed() -> bool:
        nonlocal found
        seen = await parts_of(b, "big", 4)
        found = seen or []
        return seen is not None and all(p.get("error") == UNTRUSTED[:256] for p in seen)

    await eventually(placed, "two replicas of two parts, each waiting for a trusted network")
    assert c_id not in {p["nodeId"] for p in found}  # never on the member with 2 free
    assert all(len(p["devices"]) == 4 for p in found)
    groups: dict[str, set[str]] = {}
    for p in found:
        groups.setdefault(p["group"], set()).add(p["nodeId"])
    assert len(groups) == 2
    assert all(len(members) == 2 for members in groups.values())  # each over both members
    # A third replica fits nowhere: a and b are full, c has 2 free.
    code, _, err = await a.cli("scale", "big", "3")
    assert code == 0, err

    async def explained() -> str:
        answer = await a.get("/v1/deployments/big/explain")
        return " ".join(answer["unplaced"])

    await eventually(lambda: _says(explained, "spans 2 members"), "the third replica explained")
    why = await explained()
    assert "2 free healthy" in why  # c's
    assert len(await replicas(a, "big")) == 4  # nothing partial placed for it
    for name in ("big", "busy"):
        code, _, err = await a.cli("undeploy", name)
        assert code == 0, err


async def _says(read: Any, text: str) -> bool:
    return text in await read()
