"""Members of two releases side by side (issue 27), with real agents: a deployment signed
by a later release's member, with fields this release does not know, is kept, relayed and
verified unchanged on every member; a member speaking a later release's range is worked
with and holds the cluster's wire version at what every member speaks; a member two
releases apart is refused with a message naming both releases, and nothing it sends is
taken. The later releases are stand-ins (`NVPAIR_TEST_SPEAKS`, `tests/fixtures/newer.py`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from agent.cluster.node_client import NodeClient
from agent.core.errors import MemberRefused
from certs import ClusterDir
from facts import wire
from facts.deployments import Deployment
from facts.records import RecordsPush
from tests.fixtures.newer import newer_statement
from tests.fixtures.records import node_record

from ..harness import Node, eventually, make_node, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")

NEXT = "0.3.0:2-3"  # one release on: speaks this release's wire version too
AFTER = "0.4.0:3-4"  # two releases on: shares no wire version with this one


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mixed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("releases")
    nodes = [make_node(root, name, None) for name in ("a", "b", "c", "next", "after")]
    nodes[3].extra_env["NVPAIR_TEST_SPEAKS"] = NEXT
    nodes[4].extra_env["NVPAIR_TEST_SPEAKS"] = AFTER
    async for started in start_cluster(nodes):
        yield started


async def status(node: Node) -> dict[str, Any]:
    code, out, err = await node.cli("cluster", "status", "--json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


async def deployment_names(node: Node) -> set[str]:
    return {d["name"] for d in await node.get("/v1/deployments")}


async def test_a_later_releases_deployment_is_kept_relayed_and_verified_unchanged(
    mixed: list[Node],
) -> None:
    a, b, c, following, _ = mixed
    ids = [await n.node_id() for n in mixed]
    b_cluster = ClusterDir(b.home / "cluster")
    identity = b_cluster.load_identity()
    declared = Deployment(id="dep_" + "3" * 26, name="newer", engine="mock", gpus=0, replicas=0)
    raw = newer_statement(
        declared,
        identity.key,
        identity.cert,
        priorityClass="batch",
        nested={"constraints": {"zone": "eu-1"}},
    )
    a_record = node_record(ids[0], node_port=a.ports["node"])
    client = NodeClient(b_cluster, lambda node: a_record if node == ids[0] else None)
    try:  # b, as a member of the next release would, tells a alone
        await client.push_records(ids[0], RecordsPush(deployments=[msgspec.Raw(raw)]))
    finally:
        await client.aclose()
    for member in (a, b, c, following):  # a relays it to every member it works with
        await eventually(lambda m=member: _holds(m, "newer"), f"{member.name} has it")
        kept = (member.home / "deployments.json").read_bytes()
        assert raw in kept, f"{member.name} kept the bytes b signed"  # unknown fields too
    (seen,) = [d for d in await c.get("/v1/deployments") if d["name"] == "newer"]
    assert (seen["by"], seen["replicas"], seen["engine"]) == (ids[1], 0, "mock")
    assert "newer" not in await deployment_names(mixed[4])  # refused: two releases apart


async def test_the_cluster_speaks_what_every_member_speaks(mixed: list[Node]) -> None:
    a, _, _, following, _ = mixed
    ids = {n.name: await n.node_id() for n in mixed}
    mine = await status(a)
    assert (mine["release"], mine["wire"]) == (wire.RELEASE, [wire.WIRE_MIN, wire.WIRE_MAX])
    await eventually(
        lambda: _member(a, ids["next"], release="0.3.0", wire=[2, 3]), "a knows next's range"
    )
    later = await status(following)
    assert later["release"] == "0.3.0"
    assert later["clusterWire"] == wire.WIRE_MAX  # held at what this release speaks
    held_back = {m["nodeId"]: m["release"] for m in later["heldBackBy"]}
    assert held_back == {ids[n]: wire.RELEASE for n in "abc"}  # the ones to upgrade
    code, out, err = await following.cli("cluster", "status")
    assert code == 0, err
    assert f"cluster wire version: {wire.WIRE_MAX}" in out
    assert f"held back by: {ids['a']} on nvpair {wire.RELEASE}" in out


async def test_a_member_two_releases_apart_is_refused_naming_both_and_nothing_taken(
    mixed: list[Node],
) -> None:
    a, b, _, _, after = mixed
    ids = {n.name: await n.node_id() for n in mixed}

    async def refused_at_a() -> str | None:
        return next(
            (r["why"] for r in (await status(a))["refused"] if r["nodeId"] == ids["after"]), None
        )

    async def a_refused_it() -> bool:
        return await refused_at_a() is not None

    await eventually(a_refused_it, "a refused after's push")
    why = await refused_at_a()
    assert why is not None
    assert "nvpair 0.4.0 (wire 3-4)" in why
    assert f"nvpair {wire.RELEASE} (wire 1-2)" in why
    seen_there = {r["nodeId"]: r["why"] for r in (await status(after))["refused"]}
    assert f"nvpair {wire.RELEASE}" in seen_there[ids["a"]]  # and the other way round
    # Nothing it signs is taken: its declaration never reaches a; b's, made after, does.
    code, _, err = await after.cli(
        "deploy", "from-after", "--engine", "mock", "--model", "m", "--gpus", "0", "--replicas", "0"
    )
    assert code == 0, err
    code, _, err = await b.cli(
        "deploy", "from-b", "--engine", "mock", "--model", "m", "--gpus", "0", "--replicas", "0"
    )
    assert code == 0, err
    await eventually(lambda: _holds(a, "from-b"), "b's deployment reaches a")
    assert "from-after" not in await deployment_names(a)
    assert ids["after"] not in {n["nodeId"] for n in await a.get("/v1/nodes")}
    # Its calls are answered with why, and change nothing.
    after_cluster = ClusterDir(after.home / "cluster")
    a_record = node_record(ids["a"], node_port=a.ports["node"])
    client = NodeClient(after_cluster, lambda node: a_record if node == ids["a"] else None)
    try:
        with pytest.raises(MemberRefused) as refused:
            await client.cordon(ids["a"], True)
    finally:
        await client.aclose()
    assert refused.value.status == 409
    assert "0.4.0" in refused.value.why
    assert not next(n for n in await a.get("/v1/nodes") if n["nodeId"] == ids["a"])["cordoned"]


async def _holds(node: Node, name: str) -> bool:
    return name in await deployment_names(node)


async def _member(node: Node, node_id: str, **expected: Any) -> bool:
    members = {m["nodeId"]: m for m in (await status(node))["members"]}
    return node_id in members and all(members[node_id][k] == v for k, v in expected.items())


async def test_a_bad_stand_in_range_stops_the_agent_with_one_line(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    node = make_node(tmp_path_factory.mktemp("bad-speaks"), "odd", None)
    code, _, err = await node.cli("cluster", "init", "--name", "lab", "--node-name", "odd")
    assert code == 0, err
    node.extra_env["NVPAIR_TEST_SPEAKS"] = "0.3.0:three"
    code, _, err = await node.cli(
        "agent", "run", "--api-port", str(node.ports["api"]),
        "--node-port", str(node.ports["node"]), "--manager-port", str(node.ports["manager"]),
        "--facade-port", str(node.ports["facade"]),
    )  # fmt: skip
    assert code != 0
    assert "NVPAIR_TEST_SPEAKS: not RELEASE:LOW-HIGH" in err
    assert "Traceback" not in err
    node.extra_env["NVPAIR_TEST_SPEAKS"] = "0.3.0:2-3"  # the control: a good one starts
    await node.start()
    await node.stop()
