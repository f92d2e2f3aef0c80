"""Token usage end to end: two real agents, the client on `a` (API keys, no engine), the
mock engine on `b`, the real `openai` client. What each job records is what the engine
reported; a client that did not ask for usage never sees the usage chunk, one that did sees
it once; `/metrics` and `nvpair jobs --usage` on the origin say the same; nothing of a
prompt is stored."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from ..harness import Engine, Node, eventually, make_node, module_engine, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARKER = "PROMPT-MARKER-usage-5eed"


engine = module_engine("llama")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> AsyncIterator[list[Node]]:
    root: Path = tmp_path_factory.mktemp("usage")
    a, b = make_node(root, "a", None), make_node(root, "b", "l4:1")
    b.extra = ["--engine", f"vllm={engine.url}"]
    a.home.mkdir(parents=True)
    (a.home / "nvpair.toml").write_text('[agent]\napi_keys = { "team-a" = "sk-usage" }\n')
    (a.home / "nvpair.toml").chmod(0o600)
    async for started in start_cluster([a, b]):

        async def ready() -> bool:
            async with client(a) as oa:
                return any(m.id == "llama" for m in (await oa.models.list()).data)

        await eventually(ready, "a sees b's engine")
        yield started


def client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="sk-usage", max_retries=0)


async def test_usage_per_job_in_metrics_and_cli(cluster: list[Node]) -> None:
    a, b = cluster
    seen: list[tuple[int, int, bool]] = []  # (prompt, completion, streamed) the client saw
    async with client(a) as oa:
        whole = await oa.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": f"one two {MARKER}"}],
            max_tokens=5,
        )  # fmt: skip
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 5)
        seen.append((3, 5, False))
        # Streamed, not asking: the facade asks the engine, and strips the chunk again.
        stream = await oa.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": f"a b c d {MARKER}"}],
            max_tokens=7, stream=True,
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert all(c.usage is None and c.choices for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("tok0")
        seen.append((5, 7, True))
        # Streamed, asking: the usage chunk comes exactly once, as the engine sent it.
        stream = await oa.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "x y"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1
        assert with_usage[0].choices == []
        assert with_usage[0].usage is not None
        assert (with_usage[0].usage.prompt_tokens, with_usage[0].usage.completion_tokens) == (2, 4)
        seen.append((2, 4, True))
        streamed = await oa.completions.create(
            model="llama", prompt="p q r s t u", max_tokens=3, stream=True
        )
        assert all(c.usage is None for c in [c async for c in streamed])
        seen.append((6, 3, True))

    jobs = await a.get_settled_jobs(4)
    code, out, err = await a.cli("jobs", "--usage", "--json")
    assert code == 0, err
    listed = sorted(json.loads(out), key=lambda j: int(j["id"]))
    assert [j["state"] for j in listed] == ["completed"] * 4
    assert len(jobs) == 4
    for job, (prompt, completion, was_streamed) in zip(listed, seen, strict=True):
        usage = job["usage"]
        assert (usage["promptTokens"], usage["completionTokens"]) == (prompt, completion)
        assert (usage["ttftMs"] is not None) == was_streamed  # TTFT: streamed answers only
        assert usage["totalMs"] >= (usage["ttftMs"] or 0)
    code, out, _ = await a.cli("jobs", "--usage")
    assert "TTFT_MS" in out.splitlines()[0]
    # b ran them but did not originate them: their usage is kept on a only.
    code, out, err = await b.cli("jobs", "--usage", "--json")
    assert code == 0, err
    assert [j["usage"] for j in json.loads(out)] == [None] * 4

    prompts = await a.metric("nvpair_tokens_total", model="llama", key="team-a", kind="prompt")
    completions = await a.metric(
        "nvpair_tokens_total", model="llama", key="team-a", kind="completion"
    )
    assert (prompts, completions) == (sum(s[0] for s in seen), sum(s[1] for s in seen))
    ok = await a.metric("nvpair_requests_total", model="llama", key="team-a", outcome="completed")
    assert ok == 4
    assert await a.metric("nvpair_time_to_first_token_seconds_count", model="llama") == 3
    assert await a.metric("nvpair_request_duration_seconds_count", model="llama") == 4
    assert await b.metric("nvpair_tokens_total", model="llama", key="team-a", kind="prompt") == 0

    # A client's model string mints no label: refused, no job, no series.
    async with client(a) as oa:
        with pytest.raises(openai.NotFoundError):
            await oa.chat.completions.create(
                model="made-up-model", messages=[{"role": "user", "content": "x"}]
            )
    async with aiohttp.ClientSession() as session, session.get(a.api + "/metrics") as r:
        metrics = await r.text()
    assert "made-up-model" not in metrics
    assert "nvpair_usage_rows_dropped 0.0" in metrics.splitlines()
    assert MARKER not in metrics
    for node in cluster:
        for db in node.home.glob("*.db*"):
            assert MARKER.encode() not in db.read_bytes()
    assert (a.home / "usage.db").exists()


async def test_an_unwritable_usage_store_is_named_in_healthz_and_catches_up(
    cluster: list[Node],
) -> None:
    a, _ = cluster

    async def failing_parts() -> list[str]:
        async with aiohttp.ClientSession() as session, session.get(a.api + "/healthz") as r:
            return [f["part"] for f in (await r.json()).get("failing", [])]

    assert "usage-store" not in await failing_parts()  # the control: healthy before
    db = sqlite3.connect(a.home / "usage.db", isolation_level=None, timeout=10)
    db.execute("BEGIN EXCLUSIVE")  # another process's write lock: every write now fails
    try:
        async with client(a) as oa:
            await oa.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "locked out"}],
                max_tokens=3,
            )  # fmt: skip

        async def named() -> bool:
            return "usage-store" in await failing_parts()

        await eventually(named, "/healthz names the usage store while it cannot be written")
    finally:
        db.rollback()
        db.close()

    async def healthy() -> bool:
        return "usage-store" not in await failing_parts()

    await eventually(healthy, "the usage store written again")
