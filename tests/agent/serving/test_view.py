"""The facade's compiled view of the cluster (agent/serving/view.py), with a fake clock: it is
reused while records stand still, so a member that came back is seen late -- and `expire()`,
which the facade asks before refusing a request, drops a view older than `RECHECK_S` (only
such a one: a flood of refusals does not compile the cluster for each)."""

from __future__ import annotations

from agent.serving.view import RECHECK_S, SchedulingView
from facts.records import Engine
from scheduler import Request, rank
from tests.fixtures.clock import FakeClock
from tests.fixtures.records import node_record

ME, PEER = "nod_me", "nod_peer"


def _serves(view: SchedulingView) -> bool:
    cluster, load = view.current()
    return bool(rank(Request("m", origin=ME), cluster, load).top(1))


def test_a_member_that_came_back_is_seen_once_a_refusal_expires_the_view(
    fake_clock: FakeClock,
) -> None:
    reachable = {PEER: False}
    peer = node_record(PEER, engines=[Engine(name="e", kind="vllm", url="http://x", models=["m"])])
    view = SchedulingView(
        self_id=ME,
        records=lambda: [node_record(ME), peer],
        record_of=lambda node: peer if node == PEER else None,
        is_member=lambda node: True,
        reachable=lambda node, now: reachable.get(node, True),
        remote_load=dict,
        clock=fake_clock,
    )
    assert not _serves(view)  # the peer is away: nothing serves m
    reachable[PEER] = True  # it comes back; its record did not change
    assert not _serves(view)  # the compiled view still has it away
    assert not view.expire()  # compiled just now: kept (a flood of refusals compiles nothing)
    fake_clock.advance(RECHECK_S * 2)
    assert view.expire()
    assert _serves(view)  # compiled again: the peer serves m
