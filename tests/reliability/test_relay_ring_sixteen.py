"""The ring relay at sixteen real managers (docs/protocol.md, "Relay"): with the origin's
links to half of them cut, every member still holds every event exactly once, in order --
the rest reach them round the ring. Sixteen processes at once: it runs in the fault tier,
beside the other many-process scenarios; the ring's rule and its eight-member runs are in
the suite (tests/workload_manager/test_relay_ring.py)."""

from __future__ import annotations

from pathlib import Path

from tests.workload_manager.cluster_harness import (
    Member,
    eventually,
    free_port,
    make_cluster,
)
from tests.workload_manager.test_inter_node import assert_exactly_once_in_order, converged


async def _stop(members: list[Member]) -> None:
    for member in members:
        if member.proc is not None and member.proc.returncode is None:
            await member.stop()


async def test_sixteen_members_converge_with_every_link_from_one_origin_to_half_cut(
    tmp_path: Path,
) -> None:
    members = make_cluster(tmp_path, [f"m{i:02}" for i in range(16)])
    origin, others = members[0], members[1:]
    cut = others[::2]  # 8 of the 15: the origin dials them on a port nobody listens on
    try:
        for member in members:
            await member.start()
        closed = {m.name: free_port() for m in cut}
        await origin.request(
            "peers:set",
            {
                "peers": [
                    {"nodeId": m.node_id, "host": "127.0.0.1", "port": closed.get(m.name, m.port)}
                    for m in others
                ]
            },
        )
        for member in others:
            await member.set_peers([m for m in members if m is not member])
        for wid in ("1", "2", "3"):
            for seq in (1, 2, 3):
                await origin.enter(wid, seq)
        await eventually(lambda: converged(members), "all 16 hold the origin's events")
        for member in others:
            assert_exactly_once_in_order(member)
        # The control: the cut bit -- the origin's links to those 8 fail, the others work.
        links = {p["nodeId"]: p for p in (await origin.status())["broadcast"]}
        assert all(links[m.node_id]["failures"] > 0 for m in cut)
        assert all(links[m.node_id]["failures"] == 0 for m in others if m not in cut)
    finally:
        await _stop(members)
