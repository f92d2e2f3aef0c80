"""A 202 from `POST /v1/jobs/events` is durable: one real agent process, killed with SIGKILL
right after the answer, lists the event's state when it starts again (issue 11)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.agent.harness import TIMEOUT, Node, make_node


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    solo = make_node(tmp_path, "a", "l4:1")
    code, _, err = await solo.cli("cluster", "init", "--name", "lab", "--node-name", "a")
    assert code == 0, err
    await solo.start()
    try:
        yield solo
    finally:
        await solo.stop()


async def test_an_acknowledged_event_survives_kill_9(node: Node) -> None:
    origin = await node.node_id()
    for seq in (1, 2, 3):
        await node.enter("j1", seq, origin)  # returns once answered 202
    assert node.proc is not None
    node.proc.kill()  # at once: the group commit's window has not passed yet
    await asyncio.wait_for(node.proc.wait(), TIMEOUT)
    await node.start()
    [job] = await node.jobs()
    assert (job["id"], job["state"], job["seq"]) == ("j1", "completed", 3)
