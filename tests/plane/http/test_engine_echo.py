"""An engine that echoes the prompt in every error field, seen from the plane (issue 12): the
failed jobs reach Postgres with their `error` a phrase of the closed vocabulary
(`agent.serving.job_errors`), and the prompt is in no row of any table nor in the plane's or the
agent's log. A real plane process on a real PostgreSQL, a real agent, real mock engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from psycopg import sql

from agent.serving.job_errors import JobError
from tests.agent.harness import Engine, Node, eventually, make_node, start_cluster, start_engine

from ..plane_process import PlaneProcess, point_at_plane

MARKER = "PROMPT-MARKER-9d1f-pl4ne"

# (path, model, stream, the engine's status, the job's error)
CASES = [
    ("/v1/chat/completions", "echo-5xx", False, 500, JobError.ENGINE_5XX),
    ("/v1/chat/completions", "echo-5xx", True, 500, JobError.ENGINE_5XX),
    ("/v1/completions", "echo-4xx", False, 422, JobError.ENGINE_4XX),
]


@pytest.fixture
async def plane(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    process = PlaneProcess(pg_dsn)
    await process.start()
    yield process
    await process.stop()


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    started = [
        await start_engine("echo-5xx", "--fail-rate", "1", "--echo-errors"),
        await start_engine("echo-4xx", "--fail-rate", "1", "--echo-errors", "--fail-status", "422"),
    ]
    yield started
    for engine in started:
        await engine.stop()


@pytest.fixture
async def node(tmp_path: Path, plane: PlaneProcess, engines: list[Engine]) -> AsyncIterator[Node]:
    """One agent serving the echoing engines, its cluster enrolled with `plane`."""
    token = (await plane.cli("enrol-cluster", "echo")).strip()
    member = make_node(tmp_path, "solo", "l4:1")
    point_at_plane(member.home, plane, token)
    member.extra = [flag for e in engines for flag in ("--engine", f"vllm={e.url}")]
    async for started in start_cluster([member]):
        yield started[0]


async def post(node: Node, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{node.ports['facade']}{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.read()


async def every_row(dsn: str) -> list[str]:
    """Every row of every table in the plane's database, as Postgres writes it as text."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        listed = await conn.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
        )
        tables = [name for (name,) in await listed.fetchall()]
        assert "jobs" in tables
        rows = []
        for table in tables:
            query = sql.SQL("SELECT t::text FROM {} t").format(sql.Identifier(table))
            rows += [row for (row,) in await (await conn.execute(query)).fetchall()]
        return rows


async def test_engine_error_text_reaches_no_plane_row(
    node: Node, plane: PlaneProcess, pg_dsn: str
) -> None:
    for path, model, stream, status, _ in CASES:
        prompt: dict[str, object] = (
            {"messages": [{"role": "user", "content": MARKER}]}
            if path.endswith("chat/completions")
            else {"prompt": MARKER}
        )
        got, body = await post(node, path, {"model": model, "stream": stream, **prompt})
        # The control: the client receives the engine's own answer, marker and all.
        assert got == status
        assert MARKER.encode() in body
    failed: list[Any] = []

    async def synced() -> bool:
        nonlocal failed
        failed = (await plane.get("/v1/jobs?limit=1000"))["jobs"]
        return len(failed) == len(CASES) and all(j["state"] == "failed" for j in failed)

    await eventually(synced, "the plane holds the three failed jobs")
    assert sorted(j["error"] for j in failed) == sorted(c[4].value for c in CASES)
    rows = await every_row(pg_dsn)
    assert any(JobError.ENGINE_5XX.value in row for row in rows)  # the search sees the jobs
    # A bytea column reads as hex: look for the marker's hex too.
    hidden = (MARKER, MARKER.encode().hex())
    assert [row for row in rows if any(h in row for h in hidden)] == []
    assert b"plane listening" in plane.log  # the search sees the plane's stderr
    assert MARKER.encode() not in plane.log
    assert node.log_count(MARKER) == 0
