"""A member cannot speak for another: records pushed to a real agent for a third node --
signed with the pusher's key, unsigned, altered after signing, or with a generation from the
future -- change nothing there; the pusher's own record is taken (issue 12, item 1). Nor can
it remove a member, or declare a deployment, in another's name (issue 12, item 2; issue 13)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import pytest_asyncio

from agent.cluster.node_client import NodeClient
from certs import ClusterDir
from certs.cluster_dir import Identity
from facts.deployments import Deployment
from facts.kept import raws
from facts.record_signing import MAX_SKEW_MS, sign_record, sign_removal, sign_statement
from facts.records import NodeRecord, RecordsPush, Removal
from tests.fixtures.records import node_record

from ..harness import Node, eventually, make_node, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("forged")
    nodes = [make_node(root, name, "l4:1") for name in "abc"]
    async for started in start_cluster(nodes):
        yield started


async def record_at(at: Node, node_id: str) -> dict[str, object]:
    return next(n for n in await at.get("/v1/nodes") if n["nodeId"] == node_id)


async def test_records_for_another_node_change_nothing(trio: list[Node]) -> None:
    a, b, _ = trio
    ids = [await n.node_id() for n in trio]
    await eventually(lambda: _knows(a, ids), "a knows every member")
    b_cluster = ClusterDir(b.home / "cluster")
    b_key = b_cluster.load_identity().key
    a_record = node_record(ids[0], node_port=a.ports["node"])
    client = NodeClient(b_cluster, lambda node: a_record if node == ids[0] else None)
    before = await record_at(a, ids[2])
    now = int(time.time() * 1000)
    hijack = node_record(ids[2], 2**62, addresses=("10.6.6.6",), cordoned=True)
    own_c = msgspec.convert(before, NodeRecord, strict=False)
    forged = [
        sign_record(hijack, b_key),  # b signs c's record
        hijack,  # unsigned
        msgspec.structs.replace(own_c, cordoned=True, generation=own_c.generation + 1),
        sign_record(node_record(ids[1], now + MAX_SKEW_MS + 600_000), b_key),  # b's, future
    ]
    try:
        await client.push_records(ids[0], RecordsPush(records=raws(forged)))
        after = await record_at(a, ids[2])
        assert (after["addresses"], after["cordoned"]) == (before["addresses"], False)
        assert int(str(after["generation"])) < 2**62
        assert int(str((await record_at(a, ids[1]))["generation"])) < now + MAX_SKEW_MS
        # The control: b's own record, signed by b, is taken at once.
        mine = sign_record(node_record(ids[1], now + 1000, name="b-renamed"), b_key)
        await client.push_records(ids[0], RecordsPush(records=raws([mine])))
        assert (await record_at(a, ids[1]))["name"] == "b-renamed"
    finally:
        await client.aclose()
    assert a.log_count("ignoring a record for") >= len(forged)  # each refusal is logged
    assert a.log_count("did not sign") >= 1


async def test_a_deployment_in_another_members_name_changes_nothing(trio: list[Node]) -> None:
    a = trio[0]
    ids = [await n.node_id() for n in trio]
    client, b_identity = b_towards_a(trio, ids)
    mine = Deployment(id="dep_" + "0" * 26, name="forged", engine="mock", gpus=0, replicas=9)
    signed = sign_statement(mine, b_identity.key, b_identity.cert)
    forged = [
        mine,  # unsigned
        msgspec.structs.replace(signed, by=ids[0]),  # b's signature, a's name
        msgspec.structs.replace(signed, replicas=64),  # altered after signing
    ]
    try:
        await client.push_records(ids[0], RecordsPush(deployments=raws(forged)))
        assert [d["name"] for d in await a.get("/v1/deployments")] == []
        # The control: b's own signed declaration is taken, b named as its author.
        await client.push_records(ids[0], RecordsPush(deployments=raws([signed])))
        (taken,) = await a.get("/v1/deployments")
        assert (taken["name"], taken["by"], taken["replicas"]) == ("forged", ids[1], 9)
    finally:
        await client.aclose()
    assert a.log_count("a deployment of forged") >= 3
    # leave nothing declared for the tests after this one
    async with aiohttp.ClientSession(headers=a.owner) as session:
        url = a.api + "/v1/deployments/forged/undeploy"
        async with session.post(url, json={}) as response:
            assert response.status == 200


async def test_a_removal_in_another_members_name_changes_nothing(trio: list[Node]) -> None:
    # Last in the module: its control removes c.
    a = trio[0]
    ids = [await n.node_id() for n in trio]
    client, b_identity = b_towards_a(trio, ids)
    signed = sign_removal(Removal(nodeId=ids[2], removedAt=1), b_identity.key, b_identity.cert)
    forged = [
        Removal(nodeId=ids[2], removedAt=1),  # unsigned
        msgspec.structs.replace(signed, by=ids[0]),  # b's signature, a's name
        msgspec.structs.replace(signed, removedAt=2),  # altered after signing
    ]
    try:
        await client.push_records(ids[0], RecordsPush(removals=raws(forged)))
        assert await _removed_by(a, ids[2]) is None  # c is still a member of a
        # The control: b's own removal of c is taken, b named as its remover.
        await client.push_records(ids[0], RecordsPush(removals=raws([signed])))
        assert await _removed_by(a, ids[2]) == ids[1]
    finally:
        await client.aclose()
    assert a.log_count(f"a removal of {ids[2]} that") >= 2


async def _removed_by(node: Node, node_id: str) -> object:
    member = next(m for m in await node.get("/v1/members") if m["nodeId"] == node_id)
    assert (member["removed"] is None) == (member["removedBy"] is None)
    return member["removedBy"]


def b_towards_a(trio: list[Node], ids: list[str]) -> tuple[NodeClient, Identity]:
    """A node client of b's that reaches a, and b's identity (what b signs with)."""
    a, b, _ = trio
    b_cluster = ClusterDir(b.home / "cluster")
    a_record = node_record(ids[0], node_port=a.ports["node"])
    client = NodeClient(b_cluster, lambda node: a_record if node == ids[0] else None)
    return client, b_cluster.load_identity()


async def _knows(node: Node, ids: list[str]) -> bool:
    return {n["nodeId"] for n in await node.get("/v1/nodes")} >= set(ids)
