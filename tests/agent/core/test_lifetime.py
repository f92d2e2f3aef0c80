"""The agent's task group and health: a task that dies is named, close is bounded."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.core.errors import AgentError
from agent.core.lifetime import Health, Tasks
from tests.fixtures.waiting import eventually


async def test_a_task_that_dies_marks_its_part_failing_with_its_traceback_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = Health()
    tasks = Tasks(health)
    started = asyncio.Event()

    async def fine() -> None:
        started.set()
        await asyncio.Event().wait()

    async def broken() -> None:
        raise OSError("disk on fire")

    tasks.spawn("heartbeat", fine())
    dead = tasks.spawn("engines", broken())
    await started.wait()
    with caplog.at_level(logging.ERROR):
        await asyncio.wait([dead])
        await eventually(lambda: bool(health.failing()), "the dead task's part reported")
    assert health.failing() == [{"part": "engines", "error": "OSError: disk on fire"}]
    assert any(r.exc_info and "engines failed" in r.getMessage() for r in caplog.records)
    await tasks.aclose()


async def test_probes_report_while_failing_and_stop_when_healed() -> None:
    health = Health()
    state = {"store": "database is locked"}
    health.watch("jobs-store", lambda: state["store"] or None)
    health.watch("workload-manager", lambda: None)
    assert health.failing() == [{"part": "jobs-store", "error": "database is locked"}]
    state["store"] = ""
    assert health.failing() == []


async def test_aclose_cancels_everything_within_its_bound() -> None:
    tasks = Tasks(Health())
    stubborn_started = asyncio.Event()
    release = asyncio.Event()

    async def stubborn() -> None:
        stubborn_started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores cancellation: close must not hang on it

    async def polite() -> None:
        await asyncio.Event().wait()

    stubborn_task = tasks.spawn("stubborn", stubborn())
    polite_task = tasks.spawn("polite", polite())
    await stubborn_started.wait()
    await asyncio.wait_for(tasks.aclose(bound_s=0.2), timeout=5)
    assert polite_task.cancelled()
    assert not stubborn_task.done()
    with pytest.raises(AgentError):
        tasks.spawn("late", polite())
    release.set()  # leave nothing behind for the next test
    await stubborn_task
