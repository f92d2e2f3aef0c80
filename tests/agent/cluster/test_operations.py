"""Cordon and drain: the pure drain step, and the loop that drives it, in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from agent.cluster.operations import (
    IllegalTransition,
    Operation,
    OperationRefused,
    Operations,
    Phase,
    Step,
    drain_step,
)
from agent.core.errors import MemberUnreachable


@pytest.mark.parametrize(
    ("active", "now", "deadline", "force", "cancelled", "step"),
    [
        (0, 0.0, None, False, False, Step.DONE),
        (0, 99.0, 10.0, False, False, Step.DONE),  # done beats a passed deadline
        (2, 5.0, None, False, False, Step.WAIT),  # no timeout: wait forever
        (2, 5.0, 10.0, False, False, Step.WAIT),
        (2, 10.0, 10.0, True, False, Step.WAIT),  # at the deadline, not past it
        (2, 11.0, 10.0, False, False, Step.FAIL),
        (2, 11.0, 10.0, True, False, Step.CANCEL),
        (2, 12.0, 10.0, True, True, Step.WAIT),  # cancelled once: wait for them to end
    ],
)
def test_drain_step(
    active: int, now: float, deadline: float | None, force: bool, cancelled: bool, step: Step
) -> None:
    assert (
        drain_step(active=active, now=now, deadline=deadline, force=force, cancelled=cancelled)
        is step
    )


def test_phases_follow_the_table() -> None:
    op = Operation("drain", "nod_x", "a")
    op.move(Phase.RUNNING)
    op.move(Phase.SUCCEEDED, "ok")
    with pytest.raises(IllegalTransition):
        op.move(Phase.RUNNING)


class World:
    """What an operation touches: a fake clock, jobs on nodes, cordons, cancellations."""

    def __init__(self) -> None:
        self.now = 0.0
        self.active: dict[str, list[str]] = {}
        self.cordons: list[tuple[str, bool]] = []
        self.cancelled: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.polls = 0
        self.looped = asyncio.Event()  # a drain loop has been round once (polled twice)
        self.member_down = False

    def operations(self) -> Operations:
        async def cordon_member(node: str, on: bool) -> None:
            if self.member_down:
                raise MemberUnreachable(f"{node}: connection refused")
            self.cordons.append((node, on))

        async def active_on(node: str) -> list[str]:
            self.polls += 1
            if self.polls >= 2:
                self.looped.set()
            return list(self.active.get(node, []))

        def cancel_here(node: str) -> int:
            self.cancelled.append(node)
            self.active[node] = []  # the cancelled jobs end
            return 1

        async def cancel_member(member: str, node: str) -> None:
            if member == "nod_down":
                raise MemberUnreachable(member)
            self.cancelled.append(f"{member} cancels on {node}")

        def spawn(part: str, coro: Coroutine[Any, Any, None]) -> object:
            self.tasks.append(asyncio.create_task(coro))
            return self.tasks[-1]

        return Operations(
            self_id="nod_me",
            requester="me",
            is_known=lambda node: node in ("nod_b",),
            cordon_here=lambda on: self.cordons.append(("nod_me", on)),
            cordon_member=cordon_member,
            active_on=active_on,
            cancel_here=cancel_here,
            cancel_member=cancel_member,
            peers=lambda: ["nod_down", "nod_b"],
            spawn=spawn,
            clock=lambda: self.now,
            poll_s=0,
        )

    async def settle(self) -> None:
        await asyncio.gather(*self.tasks)


async def test_cordon_here_and_on_a_member() -> None:
    world = World()
    ops = world.operations()
    ops.start("cordon", "nod_me", reason="maintenance", timeout_s=None, force=False)
    ops.start("uncordon", "nod_b", reason="", timeout_s=None, force=False)
    await world.settle()
    assert world.cordons == [("nod_me", True), ("nod_b", False)]
    assert [v["phase"] for v in ops.views()] == ["succeeded", "succeeded"]


async def test_unknown_kind_or_target_is_refused() -> None:
    ops = World().operations()
    with pytest.raises(OperationRefused):
        ops.start("reboot", "nod_me", reason="", timeout_s=None, force=False)
    with pytest.raises(OperationRefused):
        ops.start("drain", "nod_nobody", reason="", timeout_s=None, force=False)
    assert ops.views() == []


async def test_a_drain_waits_then_succeeds_when_the_jobs_end() -> None:
    world = World()
    world.active["nod_b"] = ["j1", "j2"]
    ops = world.operations()
    op = ops.start("drain", "nod_b", reason="", timeout_s=60, force=False)
    await world.looped.wait()
    assert op.phase is Phase.RUNNING
    assert op.waiting_for is not None
    assert "2 job(s)" in op.waiting_for
    world.active["nod_b"] = []
    await world.settle()
    assert op.view()["phase"] == "succeeded"
    assert world.cancelled == []


async def test_a_drain_past_its_timeout_fails_or_with_force_cancels() -> None:
    ops_by_force = {}
    for force in (False, True):
        world = World()
        world.active["nod_b"] = ["j1"]
        op = world.operations().start("drain", "nod_b", reason="", timeout_s=5, force=force)
        await world.looped.wait()
        world.now = 6.0
        await world.settle()
        ops_by_force[force] = (op.view(), world.cancelled)
    failing, nothing_cancelled = ops_by_force[False]
    assert failing["phase"] == "failed"
    assert "still waiting for 1 job(s)" in str(failing["result"])
    assert nothing_cancelled == []
    forced, cancelled = ops_by_force[True]
    assert forced["phase"] == "succeeded"
    # Here, and every member's facade that can be reached (one is down: no failure).
    assert cancelled == ["nod_b", "nod_b cancels on nod_b"]


async def test_an_unreachable_member_fails_the_operation_with_why() -> None:
    world = World()
    world.member_down = True
    ops = world.operations()
    op = ops.start("cordon", "nod_b", reason="", timeout_s=None, force=False)
    await world.settle()
    assert op.phase is Phase.FAILED
    assert op.result is not None
    assert "connection refused" in op.result
