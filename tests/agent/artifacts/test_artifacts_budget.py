"""The disk budget never evicts what a replica uses (issue 28), with real agents: b's store
may hold one and a half artifacts (`[artifacts] max_bytes`); while a replica on b loads X,
fetching Y is refused saying why and X stays resident under the ready replica; once X's
deployment is gone, fetching Y drops X to make room (the control)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, ready_everywhere, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIZE = 1024 * 1024


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    budget = f"[artifacts]\nmax_bytes = {SIZE * 3 // 2}\n"
    root = tmp_path_factory.mktemp("artifacts-budget")
    async for started in engine_cluster(root, {"a": "l4:1", "b": "l4:1"}, extra_toml=budget):
        yield started


async def here(node: Node, name: str) -> str:
    found = [x for x in await node.get("/v1/artifacts") if x["name"] == name]
    return str(found[0]["here"]) if found else "unknown"


async def test_an_artifact_a_replica_loads_is_never_evicted(
    pair: list[Node], tmp_path: Path
) -> None:
    a, b = pair  # each store may hold one and a half artifacts
    for name in ("x", "y"):
        (tmp_path / name).write_bytes(os.urandom(SIZE))
    code, _, err = await a.cli("artifact", "add", str(tmp_path / "x"), "--name", "x")
    assert code == 0, err
    await eventually(lambda: _absent(b, "x"), "b learns of x")
    code, _, err = await a.cli(
        "deploy", "uses-x", "--artifact", "x", "--engine", "mock", "--node", "b"
    )
    assert code == 0, err
    await eventually(lambda: ready_everywhere(pair, "uses-x", 1), "uses-x ready on b", within_s=60)
    assert await here(b, "x") == "resident"
    code, _, err = await a.cli("artifact", "add", str(tmp_path / "y"), "--name", "y")
    assert code == 0, err  # a drops its own x for y: no replica of a uses x
    await eventually(lambda: _absent(b, "y"), "b learns of y")
    code, _, err = await b.cli("artifact", "fetch", "y")
    assert code != 0
    assert "budget" in err
    assert "in use or pinned" in err
    assert await here(b, "x") == "resident"  # kept under its replica
    assert [r["state"] for r in await replicas(b, "uses-x")] == ["ready"]
    # The control: without the replica, x is the least recently used and goes.
    code, _, err = await a.cli("undeploy", "uses-x")
    assert code == 0, err
    await eventually(lambda: _none(b, "uses-x"), "uses-x's replica gone from b")
    code, out, err = await b.cli("artifact", "fetch", "y", "--wait")
    assert code == 0, err
    assert "y: resident" in out
    assert await here(b, "x") == "absent"


async def _absent(node: Node, name: str) -> bool:
    return await here(node, name) == "absent"


async def _none(node: Node, deployment: str) -> bool:
    return not await replicas(node, deployment)
