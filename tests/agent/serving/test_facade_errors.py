"""An engine that echoes the prompt in every error field: the client gets the engine's answer
as it is, but the marker reaches no job, no log and no database -- a job's error is a phrase
of the closed vocabulary (`agent.serving.job_errors`). A real agent, real mock engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agent.serving.job_errors import JobError
from agent.serving.relay import for_exception

from ..harness import Node, make_node, start_cluster, start_engine

MARKER = "PROMPT-MARKER-ec40-b0dy"


@pytest.fixture
async def echoing(tmp_path: Path) -> AsyncIterator[Node]:
    engines = [
        await start_engine("echo-5xx", "--fail-rate", "1", "--echo-errors"),
        await start_engine("echo-4xx", "--fail-rate", "1", "--echo-errors", "--fail-status", "422"),
    ]
    node = make_node(tmp_path, "solo", "l4:1")
    node.extra = [flag for e in engines for flag in ("--engine", f"vllm={e.url}")]
    try:
        async for started in start_cluster([node]):
            yield started[0]
    finally:
        for engine in engines:
            await engine.stop()


async def post(node: Node, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{node.ports['facade']}{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.read()


async def test_engine_error_text_is_never_copied(echoing: Node) -> None:
    node = echoing
    cases = [
        ("/v1/chat/completions", "echo-5xx", False, 500, JobError.ENGINE_5XX),
        ("/v1/chat/completions", "echo-5xx", True, 500, JobError.ENGINE_5XX),
        ("/v1/completions", "echo-4xx", False, 422, JobError.ENGINE_4XX),
    ]
    for path, model, stream, status, _ in cases:
        prompt: dict[str, object] = (
            {"messages": [{"role": "user", "content": MARKER}]}
            if path.endswith("chat/completions")
            else {"prompt": MARKER}
        )
        got, body = await post(node, path, {"model": model, "stream": stream, **prompt})
        # The control: the client receives the engine's own answer, marker and all.
        assert got == status
        assert MARKER.encode() in body
    jobs = await node.get_settled_jobs(len(cases))
    assert sorted(j["error"] for j in jobs) == sorted(c[4].value for c in cases)
    assert all(j["state"] == "failed" for j in jobs)
    # Nowhere else: not the Jobs list, the agent's log (debug level), nor the bytes of
    # jobs.db or usage.db (a failed job has a usage row too: its times).
    assert MARKER not in str(await node.jobs())
    assert node.log is not None
    assert node.log_count(MARKER) == 0
    stored = [p for p in node.home.iterdir() if p.name.startswith(("jobs.db", "usage.db"))]
    assert {p.name for p in stored} >= {"jobs.db", "usage.db"}
    assert all(MARKER.encode() not in p.read_bytes() for p in stored)


@pytest.mark.parametrize(
    ("exc", "local", "want"),
    [
        (TimeoutError(), True, JobError.ENGINE_TIMED_OUT),
        (aiohttp.ServerTimeoutError("read"), True, JobError.ENGINE_TIMED_OUT),
        (ConnectionRefusedError(), True, JobError.ENGINE_REFUSED),
        (aiohttp.ServerDisconnectedError(), True, JobError.ENGINE_CLOSED),
        (aiohttp.ClientPayloadError("cut"), True, JobError.ENGINE_CLOSED),
        (OSError("no route"), True, JobError.ENGINE_UNREACHABLE),
        (ConnectionRefusedError(), False, JobError.MEMBER_UNREACHABLE),
    ],
)
def test_failures_map_to_the_vocabulary(exc: BaseException, local: bool, want: JobError) -> None:
    assert for_exception(exc, local=local) is want
