"""The ring relay (docs/protocol.md, "Relay"): the origin sends each event to every peer and
a member forwards a first-seen remote event to one ring successor only, so an event costs
about 2(N-1) link deliveries instead of (N-1)², and still reaches a member its origin
cannot reach -- through crashes and cut links -- by going round the ring.

Real manager processes on 127.0.0.1 (`cluster_harness`), a pure test of the successor rule.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workload_manager.broadcaster import ring_successor

from .cluster_harness import Member, eventually, make_cluster
from .test_inter_node import assert_exactly_once_in_order, converged

# -- the successor rule -----------------------------------------------------------------------

_ids = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=0, max_size=12, unique=True)


@given(_ids, st.text("abcdefgh", min_size=1, max_size=3), st.data())
def test_the_successor_is_the_first_healthy_member_after_this_one(
    ring: list[str], own: str, data: st.DataObject
) -> None:
    ring = sorted(ring)
    exclude = tuple(data.draw(st.lists(st.sampled_from(ring))) if ring else [])
    failing = set(data.draw(st.lists(st.sampled_from(ring))) if ring else [])
    got = ring_successor(ring, own, exclude, lambda peer: peer not in failing)
    eligible = [p for p in ring if p != own and p not in exclude and p not in failing]
    if not eligible:
        assert got is None
        return
    after = [p for p in eligible if p > own]
    assert got == (after[0] if after else eligible[0])  # the next one, wrapping round


def test_the_successor_wraps_and_skips_the_sender_the_origin_and_failing_links() -> None:
    ring = ["a", "b", "c", "d", "e"]
    assert ring_successor(ring, "c", (), lambda p: True) == "d"
    assert ring_successor(ring, "e", (), lambda p: True) == "a"  # wraps
    assert ring_successor(ring, "c", ("d", "a"), lambda p: True) == "e"
    assert ring_successor(ring, "c", ("d",), lambda p: p != "e") == "a"  # e's link fails
    assert ring_successor(ring, "c", (), lambda p: False) is None
    assert ring_successor([], "c", (), lambda p: True) is None


# -- real managers ------------------------------------------------------------------------------


async def _start(members: list[Member], peers: dict[str, list[Member]] | None = None) -> None:
    for member in members:
        await member.start()
    for member in members:
        await member.set_peers(
            (peers or {}).get(member.name, [m for m in members if m is not member])
        )


async def _stop(members: list[Member]) -> None:
    for member in members:
        if member.proc is not None and member.proc.returncode is None:
            await member.stop()


async def _remote_received(members: list[Member]) -> int:
    return sum([(await m.status())["counters"]["received_remote"] for m in members])


@pytest.fixture
async def eight(tmp_path: Path) -> AsyncIterator[list[Member]]:
    members = make_cluster(tmp_path, [f"m{i}" for i in range(8)])
    yield members
    await _stop(members)


@pytest.mark.parametrize("mode", ["ring", "flood"])
async def test_deliveries_per_event_ring_about_two_n_flood_about_n_squared(
    eight: list[Member], mode: str
) -> None:
    n = len(eight)
    for member in eight:
        member.env["NVPAIR_WM_RELAY"] = mode
    await _start(eight)
    assert {status["relay"] for status in [await m.status() for m in eight]} == {mode}
    before = await _remote_received(eight)
    events = 0
    for origin in eight[:3]:
        for wid in range(6):  # distinct jobs: an outbox coalesces one job's steps
            await origin.enter(str(wid), 1)
            events += 1
    await eventually(lambda: converged(eight), "every member holds every event")
    for member in eight:
        assert_exactly_once_in_order(member)

    async def settled() -> bool:  # the forwards after the last first-seen counted too
        statuses = [await m.status() for m in eight]
        return all(p["queued"] == 0 for status in statuses for p in status["broadcast"])

    await eventually(settled, "every outbox empty")
    per_event = (await _remote_received(eight) - before) / events
    if mode == "ring":
        assert per_event <= 2 * n, per_event
    else:  # the control: the same events cost about (N-1)² when every member floods
        assert per_event >= (n - 1) * (n - 2), per_event


async def test_an_event_its_origin_sent_to_one_member_only_goes_round_the_ring(
    tmp_path: Path,
) -> None:
    # What an origin that crashed right after its first send leaves: one member holds the
    # event, and the ring alone takes it to the rest.
    members = make_cluster(tmp_path, [f"r{i}" for i in range(6)])
    origin = members[0]
    try:
        await _start(members, {origin.name: [members[3]]})
        await origin.enter("1", 1)
        await origin.enter("1", 2)
        await eventually(lambda: converged(members), "all six hold the event")
        for member in members[1:]:
            assert_exactly_once_in_order(member)
    finally:
        await _stop(members)
