"""llama.cpp's real `llama-server`, on CPU, launched by real agents from the built-in
`llamacpp` template (issue 14, item 2): readiness through the loading phase; `/v1/models`
(which lists deployments with a ready replica); chat (streamed and
not) and completions through any member with the `openai` client; the usage a client gets
equals the server's own token counters; the server's `llamacpp:*` load reaches the replica
records and `nvpair explain`; kill -9 restarts it; a corrupt model fails the replica with
the server's own log lines and leaves the agent serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.load import parse_engine_load
from tests.agent.deploy_harness import engine_cluster, engine_pids, replicas
from tests.agent.harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

# One slot: two long requests at once make one running and one waiting (deferred).
ENGINE_ARGS = ("--parallel", "1")
LONG = {"ignore_eos": True}  # random weights say EOS at random; a long answer must be long


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(
    llama_server: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[Node]]:
    # `llama_server` first: it puts the server's folder on the PATH the agents inherit.
    root = tmp_path_factory.mktemp("real-engine")
    async for started in engine_cluster(root, {"a": None, "b": None}):
        yield started


def client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


async def engine_get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


async def counters(port: int) -> dict[str, float]:
    """The server's own `llamacpp:*` samples, by name."""
    status, text = await engine_get(port, "/metrics")
    assert status == 200, text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("llamacpp:")
    }


def engine_log(home: Path, replica_id: str) -> str:
    return (home / "replicas" / replica_id / "engine.log").read_text(errors="replace")


async def the_replica(node: Node, deployment: str) -> dict[str, Any]:
    (seen,) = await replicas(node, deployment)
    return seen


async def test_the_replica_is_ready_only_once_the_server_answers_health(
    pair: list[Node], tiny_model: Path
) -> None:
    a, b = pair
    code, out, err = await a.cli(
        "deploy", "tiny", "--engine", "llamacpp", "--model", str(tiny_model), "--gpus", "0",
        "--node", "b", "--", *ENGINE_ARGS,
    )  # fmt: skip
    assert code == 0, err + out
    states: list[str] = []
    health_when_ready: list[int] = []

    async def ready() -> bool:
        seen = await replicas(b, "tiny")
        if not seen:
            return False
        states.append(seen[0]["state"])
        if seen[0]["state"] != "ready":
            return False
        health_when_ready.append((await engine_get(seen[0]["port"], "/health"))[0])
        return True

    await eventually(ready, "the llama.cpp replica on b is ready", within_s=120)
    # Before it was ready it was only ever starting (the tiny model loads in well under a
    # second, so a poll may not catch that phase: the server's log below shows it).
    assert set(states[:-1]) <= {"starting"}, states
    assert health_when_ready == [200]
    (rid,) = engine_pids(b.home)
    log = engine_log(b.home, rid)
    # The real server loaded the model behind that wait: its own words, in order.
    assert log.index("load_model: loading model") < log.index("model loaded"), log[-3000:]
    assert "['llama-server', '-m', " in log  # the built-in template's command line


async def test_the_server_serves_the_deployment_under_its_name(pair: list[Node]) -> None:
    status, text = await engine_get((await the_replica(pair[1], "tiny"))["port"], "/v1/models")
    assert status == 200, text
    assert "tiny" in [m["id"] for m in json.loads(text)["data"]]  # --alias {served}

    async def version_known() -> bool:  # the server's own build_info (GET /props)
        return bool((await the_replica(pair[0], "tiny"))["engineVersion"])

    await eventually(version_known, "the llama.cpp replica's engine version in the records")


async def test_models_lists_the_deployment_through_any_member(pair: list[Node]) -> None:
    for node in pair:
        async with client(node) as api:
            models = await api.models.list()
        assert "tiny" in [m.id for m in models.data]


async def test_chat_and_completions_through_any_member(pair: list[Node]) -> None:
    for node in pair:
        async with client(node) as api:
            answer = await api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
            )
            assert answer.choices[0].message.content is not None
            assert answer.usage is not None
            assert answer.usage.completion_tokens >= 1
            # Greedy, so the random-weight model says the same every run: sampled, its eight
            # tokens were now and then all pieces of characters, streamed as no text at all.
            chunks = [
                chunk
                async for chunk in await api.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=8, stream=True, stream_options={"include_usage": True},
                    temperature=0, seed=7,
                )
            ]  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text  # the real server's delta chunks, through nvpair
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens >= 1
            completion = await api.completions.create(
                model="tiny", prompt="the model", max_tokens=8
            )
            assert completion.choices[0].text is not None
            assert completion.usage is not None
            assert completion.usage.prompt_tokens >= 1


async def test_usage_equals_the_servers_own_token_counters(pair: list[Node]) -> None:
    a, b = pair
    port = (await the_replica(b, "tiny"))["port"]
    before = await counters(port)
    async with client(a) as api:
        answer = await api.chat.completions.create(
            model="tiny", max_tokens=17, extra_body=LONG,
            messages=[{"role": "user", "content": "the engine token world, counted"}],
        )  # fmt: skip
    after = await counters(port)
    assert answer.usage is not None
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert answer.usage.completion_tokens == 17  # ignore_eos: as many as asked for
    assert delta["llamacpp:tokens_predicted_total"] == answer.usage.completion_tokens
    prompt = delta["llamacpp:prompt_tokens_total"] + delta["llamacpp:prompt_tokens_cached_total"]
    assert prompt == answer.usage.prompt_tokens


async def test_a_stream_not_asking_for_usage_gets_none_and_its_job_has_the_servers_counts(
    pair: list[Node],
) -> None:
    # The origin asks the real server for usage, strips its usage chunk from what the
    # client gets, and keeps the counts on the job (issue 15, item 2).
    a, b = pair
    port = (await the_replica(b, "tiny"))["port"]
    before = await counters(port)
    async with client(a) as api:
        stream = await api.chat.completions.create(
            model="tiny", max_tokens=9, extra_body=LONG, stream=True,
            messages=[{"role": "user", "content": "count the tokens of this stream"}],
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    after = await counters(port)
    assert chunks
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    code, out, err = await a.cli("jobs", "--usage", "--json")
    assert code == 0, err
    newest = max(json.loads(out), key=lambda j: (j["createdAt"], int(j["id"])))
    usage = newest["usage"]
    assert usage["completionTokens"] == 9
    predicted = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert usage["completionTokens"] == predicted
    prompt = sum(
        after[n] - before.get(n, 0.0)
        for n in ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total")
    )
    assert usage["promptTokens"] == prompt
    assert 0 <= usage["ttftMs"] <= usage["totalMs"]


async def test_the_servers_load_reaches_the_records_and_explain(pair: list[Node]) -> None:
    a, b = pair
    port = (await the_replica(b, "tiny"))["port"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 4000, **LONG}  # fmt: skip
    url = f"http://127.0.0.1:{a.ports['facade']}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        long_ones = [asyncio.create_task(_post(session, url, body)) for _ in range(3)]
        try:

            async def busy_in_a_view() -> bool:
                seen = await the_replica(a, "tiny")  # b's record, as a holds it
                return bool(seen["running"] == 1 and seen["waiting"] >= 1)

            await eventually(busy_in_a_view, "a's view shows b's server busy and queueing")
            # The same figures the server itself says, read the agent's way.
            _, text = await engine_get(port, "/metrics")
            assert parse_engine_load(text, at_ms=0).running == 1
            code, out, err = await a.cli("explain", "tiny", "--json")
            assert code == 0, err
            (entry,) = json.loads(out)["replicas"]["ranked"]
            assert entry["node"] == "b"
            assert entry["running"] is not None
            assert entry["running"] + entry["waiting"] >= 1
        finally:
            for task in long_ones:
                task.cancel()
            await asyncio.gather(*long_ones, return_exceptions=True)

    async def idle() -> bool:
        seen = await the_replica(a, "tiny")
        return bool(seen["running"] == 0 and seen["waiting"] == 0)

    await eventually(idle, "the load falls back to nothing once the requests are gone", within_s=60)


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> int:
    async with session.post(url, json=body) as response:
        await response.read()
        return response.status


async def test_a_server_killed_hard_is_restarted(pair: list[Node]) -> None:
    a, b = pair
    ((rid, pid),) = engine_pids(b.home).items()
    os.kill(pid, signal.SIGKILL)

    async def back() -> bool:
        now = engine_pids(b.home).get(rid)
        seen = await replicas(b, "tiny")
        return now not in (None, pid) and [r["state"] for r in seen] == ["ready"]

    await eventually(back, "b's llama-server restarted with a new pid, ready", within_s=120)
    assert (await the_replica(b, "tiny"))["restarts"] >= 1
    async with client(a) as api:
        answer = await api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4
        )
    assert answer.usage is not None
    assert answer.usage.completion_tokens >= 1


@pytest.fixture
def broken_model(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model cut off half way, as an interrupted copy leaves it."""
    whole = tiny_model.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(whole[: len(whole) // 2])
    return broken


async def test_a_corrupt_model_fails_with_the_servers_log_and_the_agent_serves_on(
    pair: list[Node], broken_model: Path
) -> None:
    a, _ = pair
    code, out, err = await a.cli(
        "deploy", "broken", "--engine", "llamacpp", "--model", str(broken_model), "--gpus", "0",
        "--node", "a",
    )  # fmt: skip
    assert code == 0, err + out

    async def failed() -> bool:
        seen = await replicas(a, "broken")
        return [r["state"] for r in seen] == ["failed"]

    await eventually(failed, "the replica of the corrupt model is failed", within_s=120)
    seen = await the_replica(a, "broken")
    assert "before it was ever ready" in seen["error"], seen
    tail = "\n".join(seen["logTail"])
    assert "failed to load model" in tail, tail  # the server's own words, on its node
    assert await a.healthy()
    async with client(a) as api:  # the other deployment is still served through a
        answer = await api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "still here"}], max_tokens=4
        )
    assert answer.choices[0].message.content is not None


async def test_the_tiny_model_as_an_artifact_added_on_a_is_served_by_a_replica_on_b(
    pair: list[Node], tiny_model: Path
) -> None:
    """Issue 28: the weights move themselves. The GGUF is added as an artifact on a only;
    the deployment is kept on b, which fetches it from a, and the real server on b loads the
    assembled copy (a single-file artifact: its file is `{model}`)."""
    a, b = pair
    code, out, err = await a.cli("artifact", "add", str(tiny_model), "--name", "tiny-gguf")
    assert code == 0, err
    digest = out.split()[2]
    code, out, err = await a.cli(
        "deploy", "tiny-art", "--engine", "llamacpp", "--artifact", "tiny-gguf", "--gpus", "0",
        "--node", "b", "--", *ENGINE_ARGS,
    )  # fmt: skip
    assert code == 0, err + out

    async def ready() -> bool:
        seen = await replicas(b, "tiny-art")
        return bool(seen) and seen[0]["state"] == "ready"

    await eventually(ready, "the artifact's replica on b is ready", within_s=120)
    copy = b.home / "artifacts" / "ready" / digest.removeprefix("sha256:") / tiny_model.name
    assert same_bytes(copy, tiny_model)  # fetched from a, byte for byte
    rid = (await the_replica(b, "tiny-art"))["id"]
    log = engine_log(b.home, rid)
    assert str(copy) in log  # the server was given the assembled copy
    assert "model loaded" in log
    async with client(a) as api:  # served through a, by b's server
        answer = await api.completions.create(model="tiny-art", prompt="hello", max_tokens=4)
    assert answer.choices[0].text is not None
    code, out, err = await a.cli("undeploy", "tiny-art")
    assert code == 0, err


def same_bytes(one: Path, other: Path) -> bool:
    return one.read_bytes() == other.read_bytes()
