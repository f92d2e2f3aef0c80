"""The calls to the plane as traces of their own (issue 31, item 2): an agent synced to a real
plane process on a real PostgreSQL, with `[tracing]` pointed at a small OTLP receiver, sends
a root span for each sync up and each desired-state fetch."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.fixtures.otlp import Received, Receiver

from ..plane_process import PlaneProcess, point_at_plane


@pytest.fixture
async def plane_process(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    started = PlaneProcess(pg_dsn)
    await started.start()
    yield started
    await started.stop()


async def test_each_sync_and_fetch_is_a_trace_of_its_own(
    plane_process: PlaneProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    plane = plane_process
    token = (await plane.cli("enrol-cluster", "traced")).strip()
    async with Receiver.running() as receiver:
        node = make_node(tmp_path_factory.mktemp("plane-traces"), "a", None)
        point_at_plane(node.home, plane, token)
        (node.home / "nvpair.toml").write_text(f'[tracing]\notlp_endpoint = "{receiver.url}"\n')
        node.extra_env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        async for (a,) in start_cluster([node]):
            await _plane_calls_traced(a, receiver)


async def _plane_calls_traced(a: Node, receiver: Receiver) -> None:
    a_id = await a.node_id()

    def plane_calls() -> dict[str, Received]:
        return {
            s.name: s
            for s in receiver.spans
            if s.instance == a_id and s.name.startswith("nvpair.plane.")
        }

    await eventually(
        lambda: {"nvpair.plane.sync", "nvpair.plane.desired"} <= set(plane_calls()),
        "a's sync and desired-state fetch, traced",
    )
    calls = plane_calls()
    assert calls["nvpair.plane.sync"].parent_id == calls["nvpair.plane.desired"].parent_id == ""
    assert calls["nvpair.plane.sync"].trace_id != calls["nvpair.plane.desired"].trace_id
    assert calls["nvpair.plane.sync"].attributes["http.response.status_code"] == 200
