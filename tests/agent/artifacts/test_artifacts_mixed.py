"""Artifacts while the cluster is mixed (issue 28 under issue 27's rules), with real agents:
beside a member that speaks wire 1 alone (a stand-in for 0.1.0, `NVPAIR_TEST_SPEAKS`), the
`artifacts` feature is off, so a deployment that names an artifact is refused with 409
naming the member that holds the feature back, and no record says what it holds (a 0.1.0
member would refuse it). A deployment without one is taken (the control). So is a deployment
with bounds (issue 30: `elastic-deployments`) refused, and a fixed one taken; and one whose
replicas span members (issue 32: `spanning-replicas`), beside one on a single member."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ..deploy_harness import post
from ..harness import Node, eventually, make_node, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("artifacts-mixed")
    nodes = [make_node(root, name, None) for name in ("a", "old")]
    nodes[1].extra_env["NVPAIR_TEST_SPEAKS"] = "0.1.0:1-1"
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 0.5\n")
    async for started in start_cluster(nodes):
        yield started


async def test_weights_wait_for_every_member_to_know_them(pair: list[Node], tmp_path: Path) -> None:
    a, old = pair
    old_id = await old.node_id()

    async def held_back() -> bool:
        code, out, _ = await a.cli("cluster", "status")
        return code == 0 and f"held back by: {old_id}" in out

    await eventually(held_back, "a sees old holding the cluster back")
    weights = tmp_path / "w"
    weights.write_bytes(os.urandom(4096))
    code, _, err = await a.cli("artifact", "add", str(weights), "--name", "w")
    assert code == 0, err
    body = {"name": "with-weights", "engine": "mock", "artifact": "w", "gpus": 0}
    status, text = await post(a, "/v1/deployments", body)
    assert status == 409, text
    assert old_id in text
    assert "artifacts" in text
    listed = [x for x in await a.get("/v1/artifacts") if x["name"] == "w"]
    assert listed[0]["here"] == "resident"
    assert listed[0]["members"] == {"a": "unknown", "old": "unknown"}  # no record says it
    status, text = await post(a, "/v1/deployments", body | {"artifact": "", "name": "plain"})
    assert status == 201, text  # the control


async def test_bounds_wait_for_every_member_to_know_them(pair: list[Node]) -> None:
    # Issue 30: a deployment that scales on load carries a field a 0.1.0 member refuses.
    a, old = pair
    old_id = await old.node_id()
    body = {"name": "elastic", "engine": "mock", "source": "m", "gpus": 0}
    status, text = await post(a, "/v1/deployments", body | {"minReplicas": 0, "maxReplicas": 2})
    assert status == 409, text
    assert old_id in text
    assert "scale on load" in text
    assert "elastic" not in {d["name"] for d in await a.get("/v1/deployments")}
    status, text = await post(a, "/v1/deployments", body | {"replicas": 0})
    assert status == 201, text  # the control: a fixed count is taken


async def test_a_replica_across_members_waits_for_every_member_to_know_it(pair: list[Node]) -> None:
    # Issue 32: `nodes`, and the parts' group and layout in the records, are fields a 0.1.0
    # member does not know (`spanning-replicas`).
    a, old = pair
    old_id = await old.node_id()
    body = {"name": "wide", "engine": "mock", "source": "m", "gpus": 0}
    status, text = await post(a, "/v1/deployments", body | {"nodes": 2})
    assert status == 409, text
    assert old_id in text
    assert "span members" in text
    assert "wide" not in {d["name"] for d in await a.get("/v1/deployments")}
    status, text = await post(a, "/v1/deployments", body | {"replicas": 0})
    assert status == 201, text  # the control: on one member, it is taken
