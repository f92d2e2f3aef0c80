"""Token usage from a real agent to a real plane (`nvpair plane serve` on PostgreSQL): the
fleet summary's tokens per key and model equal the origin's `/metrics`, which equal what the
engine reported to the client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.agent.harness import Node, eventually, make_node, start_cluster, start_engine

from ..plane_process import PlaneProcess, point_at_plane


@pytest.fixture
async def plane(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    process = PlaneProcess(pg_dsn)
    await process.start()
    yield process
    await process.stop()


async def test_the_plane_sums_the_tokens_the_origin_counted(
    tmp_path: Path, plane: PlaneProcess
) -> None:
    engine = await start_engine("llama")
    token = (await plane.cli("enrol-cluster", "lab")).strip()
    a = make_node(tmp_path, "a", "l4:1")
    a.extra = ["--engine", f"vllm={engine.url}"]
    point_at_plane(a.home, plane, token)
    (a.home / "nvpair.toml").write_text('[agent]\napi_keys = { "team-a" = "sk-plane" }\n')
    (a.home / "nvpair.toml").chmod(0o600)
    try:
        async for (node,) in start_cluster([a]):
            reported = await three_requests(node)
            metrics = {
                kind: await node.metric(
                    "nvpair_tokens_total", model="llama", key="team-a", kind=kind
                )
                for kind in ("prompt", "completion")
            }
            assert (metrics["prompt"], metrics["completion"]) == reported
            expected = {"promptTokens": reported[0], "completionTokens": reported[1], "jobs": 3}

            async def summed(expected: dict[str, int] = expected) -> bool:
                usage: dict[str, Any] = (await plane.get("/v1/fleet/summary"))["jobs"]["usage"]
                return usage == {"byModel": {"llama": expected}, "byKey": {"team-a": expected}}

            await eventually(summed, "the plane sums the tokens of the three jobs")
            text = await plane.cli("fleet")
            assert f"tokens by key team-a: {reported[0]} prompt, {reported[1]} completion" in text
    finally:
        await engine.stop()


async def three_requests(node: Node) -> tuple[int, int]:
    """A plain chat, a stream not asking for usage and a completion; the tokens the engine
    reported (the stream's are the mock engine's: its prompt's words, `max_tokens`)."""
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="sk-plane", max_retries=0) as oa:

        async def served() -> bool:
            return any(m.id == "llama" for m in (await oa.models.list()).data)

        await eventually(served, "the engine's model is served")
        chat = await oa.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "a b c"}], max_tokens=4
        )
        stream = await oa.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "d e"}], max_tokens=6,
            stream=True,
        )  # fmt: skip
        assert all(c.usage is None for c in [c async for c in stream])
        text = await oa.completions.create(model="llama", prompt="f", max_tokens=2)
    assert chat.usage is not None
    assert text.usage is not None
    return (
        chat.usage.prompt_tokens + 2 + text.usage.prompt_tokens,
        chat.usage.completion_tokens + 6 + text.usage.completion_tokens,
    )
