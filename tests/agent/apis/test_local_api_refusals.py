"""Refusals of the local API, on one agent shared by the module (each check is followed by a
control that still works, so a refusal that changed something would show): bad events,
bad queries, bad operations, bad cursors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from agent.app.daemon import Agent
from tests.agent.apis.test_local_api import call, event, started_solo
from tests.fixtures.records import workload_record

pytestmark = pytest.mark.asyncio(loop_scope="module")

RECORD = workload_record("bad", 1, origin="nod_elsewhere")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Agent]:
    async with started_solo(tmp_path_factory.mktemp("refusals")) as node:
        yield node


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/jobs/events", b"{not json"),
        ("POST", "/v1/jobs/events", {"method": "workload:exploded", "params": {}}),
        ("POST", "/v1/jobs/events", {"method": "workload:submitted", "params": {"x": 1}}),
        ("GET", "/v1/jobs?state=lost", None),
        ("GET", "/v1/jobs?limit=many", None),
        ("GET", "/v1/explain", None),
        # Nested past the recursion limit: msgspec's RecursionError was a 500.
        ("POST", "/v1/jobs/events", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        ("POST", "/v1/jobs/events", b'{"method": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("POST", "/v1/ops", b"[" * 100_000),
        ("POST", "/v1/jobs/ok/remove", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        # `POST /v1/usage` skips unknown fields: this one was still a 500.
        ("POST", "/v1/usage", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        # A method that is not a string (was a TypeError, a 500), a seq past int64 (taken,
        # it failed every later write of the Jobs store: the control below saw a 503).
        ("POST", "/v1/jobs/events", {"method": [], "params": {"workloadInfo": RECORD}}),
        (
            "POST",
            "/v1/jobs/events",
            {"method": "workload:submitted", "params": {"workloadInfo": {**RECORD, "seq": 2**63}}},
        ),
        # Another node's job: only a node speaks for its own jobs (issue 25, item 2).
        (
            "POST",
            "/v1/jobs/events",
            {"method": "workload:submitted", "params": {"workloadInfo": RECORD}},
        ),
        ("POST", "/v1/ops", b"[]"),
        ("POST", "/v1/ops", {"kind": "reboot", "target": "x"}),
        ("POST", "/v1/ops", {"kind": "drain", "target": "nod_nobody"}),
    ],
)
async def test_bad_input_is_400_and_changes_nothing(
    agent: Agent, method: str, path: str, body: Any
) -> None:
    status, answer = await call(agent, method, path, body)
    assert status == 400, answer
    # The control: the agent still takes a good event and lists it.
    status, _ = await call(agent, "POST", "/v1/jobs/events", event(agent, "ok", 1, "queued"))
    assert status == 202
    status, jobs = await call(agent, "GET", "/v1/jobs")
    assert [j["id"] for j in jobs] == ["ok"]
    assert (await call(agent, "GET", "/v1/ops"))[1] == []


async def test_a_mismatched_state_is_refused(agent: Agent) -> None:
    bad = event(agent, "1", 1, "queued")
    bad["method"] = "workload:completed"  # a completed event cannot carry "queued"
    status, _ = await call(agent, "POST", "/v1/jobs/events", bad)
    assert status == 400


@pytest.mark.parametrize("cursor", ["nonsense", "WzEsMl0", "%00"])
async def test_a_bad_jobs_cursor_is_400(agent: Agent, cursor: str) -> None:
    status, text = await call(agent, "GET", f"/v1/jobs?after={cursor}")
    assert status == 400
    assert "not a cursor this node gave out" in text
