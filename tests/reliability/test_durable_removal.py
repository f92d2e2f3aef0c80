"""A removal is never forgotten: a member that was down while another was removed learns it
from a member that has restarted since -- the tombstone is on disk and pushed again -- and
never pins the removed member back; a node that joins after the removal, while that stale
member still offers the removed one's certificate and record, never pins it either, and
refuses the removed member's own certificate (issue 12, item 2)."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp

from certs import ClusterDir
from tests.agent.harness import Node, eventually, make_node, start_cluster


async def removed_at(node: Node, node_id: str) -> bool:
    members = {m["nodeId"]: m for m in await node.get("/v1/members")}
    return node_id in members and members[node_id]["removed"] is not None


async def test_a_removal_outlives_a_restart_and_reaches_a_member_that_was_down(
    tmp_path: Path,
) -> None:
    nodes = [make_node(tmp_path, name, "l4:1") for name in "abc"]
    d = make_node(tmp_path, "d", "l4:1")  # joins after the removal
    async for _ in start_cluster(nodes):
        try:
            a, b, c = nodes
            await scenario(a, b, c, d)
        finally:
            await d.stop()


async def scenario(a: Node, b: Node, c: Node, d: Node) -> None:
    b_id = await b.node_id()
    await eventually(lambda: _pinned_everywhere([a, b, c], b_id), "every member pins b")
    await c.stop()  # c is down while b is removed
    code, _, err = await a.cli("cluster", "remove", b_id)
    assert code == 0, err
    assert await removed_at(a, b_id)
    await b.stop()
    await a.stop()  # a rolling restart: a keeps only what is on disk
    await a.start()
    assert await removed_at(a, b_id)  # its own tombstone, from disk
    await join(a, d)  # d joins while c, which still pins b, is down
    assert await removed_at(d, b_id)  # from the join answer, before d pinned anything
    await c.start()
    # c still pins b from before; it learns the removal from a's push.
    await eventually(lambda: removed_at(c, b_id), "c learns that b was removed")
    assert await removed_at(a, b_id)  # and c's stale pin of b did not bring b back at a
    # What c took is a's signed statement, kept across a's restart: a is named its remover.
    a_id = await a.node_id()
    assert {m["nodeId"]: m["removedBy"] for m in await c.get("/v1/members")}[b_id] == a_id
    # c's stale view reached d (c's record is there) and did not bring b back at d.
    c_id = await c.node_id()
    await eventually(lambda: _has_record(d, c_id), "d has c's record")
    assert await removed_at(d, b_id)
    assert b_id not in {n["nodeId"] for n in await d.get("/v1/nodes")}
    # b's own certificate gets nothing from d, while the control, a member's, does.
    assert await _push_status(b, d) == 403
    assert await _push_status(c, d) == 200


async def join(admitter: Node, joiner: Node) -> None:
    code, token, err = await admitter.cli("cluster", "invite")
    assert code == 0, err
    address = f"127.0.0.1:{admitter.ports['node']}"
    code, _, err = await joiner.cli("cluster", "join", address, token.strip(), "--name", "d")
    assert code == 0, err
    await joiner.start()


async def _has_record(node: Node, node_id: str) -> bool:
    return node_id in {n["nodeId"] for n in await node.get("/v1/nodes")}


async def _push_status(caller: Node, server: Node) -> int:
    """POST an empty records push to `server`'s node API with `caller`'s certificate."""
    cluster = ClusterDir(caller.home / "cluster")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the server's side is not what is tested here
    context.load_cert_chain(cluster.node_crt, cluster.node_key)
    url = f"https://127.0.0.1:{server.ports['node']}/v1/records"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={}, ssl=context) as response,
    ):
        return response.status


async def _pinned_everywhere(nodes: list[Node], node_id: str) -> bool:
    for node in nodes:
        members = {m["nodeId"]: m for m in await node.get("/v1/members")}
        if node_id not in members or members[node_id]["removed"] is not None:
            return False
    return True
