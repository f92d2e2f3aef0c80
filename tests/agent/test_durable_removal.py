"""A removal is never forgotten: a member that was down while another was removed learns it
from a member that has restarted since -- the tombstone is on disk and pushed again -- and
never pins the removed member back (issue 12, item 2)."""

from __future__ import annotations

from pathlib import Path

from .harness import Node, eventually, make_node, start_cluster


async def removed_at(node: Node, node_id: str) -> bool:
    members = {m["nodeId"]: m for m in await node.get("/v1/members")}
    return node_id in members and members[node_id]["removed"] is not None


async def test_a_removal_outlives_a_restart_and_reaches_a_member_that_was_down(
    tmp_path: Path,
) -> None:
    nodes = [make_node(tmp_path, name, "l4:1") for name in "abc"]
    async for _ in start_cluster(nodes):
        await scenario(*nodes)


async def scenario(a: Node, b: Node, c: Node) -> None:
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
    await c.start()
    # c still pins b from before; it learns the removal from a's push.
    await eventually(lambda: removed_at(c, b_id), "c learns that b was removed")
    assert await removed_at(a, b_id)  # and c's stale pin of b did not bring b back at a
    # What c took is a's signed statement, kept across a's restart: a is named its remover.
    a_id = await a.node_id()
    assert {m["nodeId"]: m["removedBy"] for m in await c.get("/v1/members")}[b_id] == a_id


async def _pinned_everywhere(nodes: list[Node], node_id: str) -> bool:
    for node in nodes:
        members = {m["nodeId"]: m for m in await node.get("/v1/members")}
        if node_id not in members or members[node_id]["removed"] is not None:
            return False
    return True
