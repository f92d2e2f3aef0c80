"""The inference facade on three real agents with real mock engines, through the real
`openai` package and plain HTTP.

One cluster (and its engines) serves the whole module. Each test takes `before`, the jobs
the cluster already held once they had all settled everywhere, and counts only the jobs it
made; the cordon test uncordons again, and the drain test, which leaves c cordoned, is last.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import pytest_asyncio

from ..harness import (
    Engine,
    JobKey,
    Node,
    eventually,
    job_key,
    make_node,
    settled_jobs,
    start_cluster,
    start_engine,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARKER = "PROMPT-MARKER-c0ffee"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engines() -> AsyncIterator[dict[str, Engine]]:
    started = {
        # a's engine is slow: 4 requests keep it busy, and its queue limit is 2
        "a": await start_engine("llama", "--latency-ms", "1500"),
        "b": await start_engine("llama", "--fail-rate", "0.2"),
        "c": await start_engine("llama,only-c", "--tokens-per-s", "20"),
    }
    yield started
    for engine in started.values():
        await engine.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    tmp_path_factory: pytest.TempPathFactory, engines: dict[str, Engine]
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("facade")
    nodes = [
        make_node(root, "a", "h100-80gb-sxm:8"),
        make_node(root, "b", "l4:2"),
        make_node(root, "c", "l4:2"),
    ]
    for node in nodes:
        node.extra = ["--engine", f"vllm={engines[node.name].url}"]
    (root / "a").mkdir()
    (root / "a" / "nvpair.toml").write_text("[agent]\nqueue_limit = 2\n")
    async for started in start_cluster(nodes):

        async def ready(started: list[Node] = started) -> bool:
            for node in started:
                models = {
                    m["id"]: m["nodes"] for m in (await node.get_facade("/v1/models"))["data"]
                }
                if len(models.get("llama", [])) != 3 or "only-c" not in models:
                    return False
            return True

        await eventually(ready, "every facade sees every engine")
        yield started


@pytest_asyncio.fixture(loop_scope="module")
async def before(cluster: list[Node]) -> set[JobKey]:
    """The jobs earlier tests left (`harness.settled_jobs`)."""
    return await settled_jobs(cluster)


def client(node: Node) -> openai.AsyncOpenAI:
    # No retries: each call must be exactly one request, so exactly one job.
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


async def test_openai_client_chat_stream_and_models(cluster: list[Node]) -> None:
    a, _, c = cluster
    async with client(c) as oa:
        reply = await oa.chat.completions.create(
            model="only-c", messages=[{"role": "user", "content": MARKER}], max_tokens=5
        )
        assert reply.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4"
        chunks = [
            chunk.choices[0].delta.content or ""
            async for chunk in await oa.chat.completions.create(
                model="only-c",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
            )
        ]
        assert "".join(chunks) == "tok0 tok1 tok2"
        models = {m.id async for m in oa.models.list()}
        assert models == {"llama", "only-c"}
    async with client(a) as oa:
        with pytest.raises(openai.NotFoundError):
            await oa.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )


async def test_a_model_only_c_serves_always_runs_on_c(
    cluster: list[Node], before: set[JobKey]
) -> None:
    a, b, c = cluster
    c_id = await c.node_id()
    for node in (a, b, a, b):
        async with client(node) as oa:
            await oa.completions.create(model="only-c", prompt=MARKER, max_tokens=2)
    jobs = await a.get_settled_jobs(4, since=before)
    assert {j["scheduledOn"] for j in jobs} == {c_id}


async def test_a_saturated_node_sends_new_work_elsewhere(
    cluster: list[Node], before: set[JobKey]
) -> None:
    a = cluster[0]
    a_id = await a.node_id()

    async def one() -> None:
        async with client(a) as oa:
            with contextlib.suppress(openai.APIStatusError):
                await oa.chat.completions.create(
                    model="llama", messages=[{"role": "user", "content": "x"}]
                )

    await asyncio.gather(*(one() for _ in range(8)))
    jobs = await a.get_settled_jobs(8, since=before)
    placed = [j["scheduledOn"] for j in jobs]
    assert placed.count(a_id) <= 2  # a's queue limit; the rest went to b and c
    assert set(placed) - {a_id}


async def test_burst_of_300_ends_the_same_everywhere(
    cluster: list[Node], before: set[JobKey]
) -> None:
    refused = 0
    dropped = 6

    async def hang_up(n: int) -> None:
        # A client that goes away mid-answer (40 tokens at 20/s on c, so 2 s): cancelled.
        # Its own session, so it is not queued behind the burst in a connection pool.
        node = cluster[n % 3]
        url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
        body = {
            "model": "only-c",
            "messages": [{"role": "user", "content": MARKER}],
            "max_tokens": 40,
        }
        async with aiohttp.ClientSession() as own:
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                timeout = aiohttp.ClientTimeout(total=1.0)
                async with own.post(url, json=body, timeout=timeout) as response:
                    await response.read()

    async def one(n: int, node: Node, session: aiohttp.ClientSession) -> None:
        nonlocal refused
        url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
        messages = [{"role": "user", "content": f"{MARKER} {n}"}]
        body = {"model": "llama", "messages": messages, "max_tokens": 2}
        async with session.post(url, json=body) as response:
            await response.read()
            refused += response.status == 429  # refused before it became a job

    seen: dict[JobKey, str] = {}

    async def hung_up_ones_started() -> bool:
        started: set[JobKey] = set()
        for node in cluster:
            for j in await node.jobs():
                if j["model"] == "only-c" and job_key(j) not in before:
                    seen[job_key(j)] = j["state"]
                    if j["state"] != "queued":
                        started.add(job_key(j))
        return len(started) >= dropped

    hang_ups = [asyncio.create_task(hang_up(n)) for n in range(dropped)]
    # They are placed and running when the burst starts (or already cancelled).
    try:
        await eventually(hung_up_ones_started, f"the {dropped} hang-ups placed on c")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; their jobs as the members list them: {seen}") from None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=60)) as session:
        await asyncio.gather(*(one(n, cluster[n % 3], session) for n in range(300 - dropped)))
    await asyncio.gather(*hang_ups)

    async def same_everywhere() -> bool:
        views = []
        for node in cluster:
            jobs = [j for j in await node.jobs() if job_key(j) not in before]
            if len(jobs) != 300 - refused or any(j["state"] in ("queued", "running") for j in jobs):
                return False
            views.append(
                sorted((j["originatedFrom"], j["runId"], j["id"], j["state"]) for j in jobs)
            )
        return views[0] == views[1] == views[2]

    await eventually(same_everywhere, "every job final and identical on every member")
    jobs = [j for j in await cluster[0].jobs() if job_key(j) not in before]
    states = [j["state"] for j in jobs]
    assert states.count("cancelled") == dropped
    assert {"completed", "failed"} <= set(states)  # b's engine fails a fifth of its requests
    # The rest of the burst was refused with 429 while members sat at their queue limits
    # (a's is 2): a refusal is no job, so it is in no list. Most of the burst is served.
    assert refused < 150


async def test_no_prompt_anywhere(cluster: list[Node], before: set[JobKey]) -> None:
    a = cluster[0]
    async with client(a) as oa:
        for model in ("llama", "only-c", "llama"):
            # b's engine fails one request in five: a failed job must not hold the prompt
            # either, so an engine's 500 is part of what is checked, not a test failure.
            with contextlib.suppress(openai.InternalServerError):
                await oa.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": MARKER}]
                )
    await a.get_settled_jobs(3, since=before)
    for node in cluster:
        jobs_text = str(await node.get("/v1/jobs"))
        async with aiohttp.ClientSession() as session, session.get(node.api + "/metrics") as r:
            metrics = await r.text()
        assert MARKER not in jobs_text
        assert MARKER not in metrics
        assert node.log is not None
        assert MARKER.encode() not in node.log.read_bytes()
        for db in node.home.glob("*.db*"):  # jobs.db and usage.db
            assert MARKER.encode() not in db.read_bytes()


async def placements(node: Node, count: int, since: set[JobKey]) -> list[str]:
    return [j["scheduledOn"] for j in await node.get_settled_jobs(count, since=since)]


async def cordoned_on(node: Node, target: str, cordoned: bool) -> bool:
    nodes = {n["nodeId"]: n for n in await node.get("/v1/nodes")}
    return bool(nodes[target]["cordoned"]) is cordoned


async def test_a_cordoned_node_gets_nothing_new(cluster: list[Node], before: set[JobKey]) -> None:
    a, b, c = cluster
    b_id = await b.node_id()
    code, out, err = await a.cli("node", "cordon", b_id)
    assert code == 0, err
    assert "succeeded" in out
    try:
        await eventually(lambda: cordoned_on(c, b_id, True), "c sees b cordoned")
        async with client(c) as oa:
            for _ in range(6):
                await oa.chat.completions.create(
                    model="llama", messages=[{"role": "user", "content": "x"}]
                )
        assert b_id not in await placements(c, 6, before)
        explained = await c.get("/v1/explain?model=llama")
        assert {"nodeId": b_id, "reason": "cordoned"} in explained["refused"]
    finally:
        # The cluster is shared: give b back to the tests after this one.
        code, _, err = await a.cli("node", "uncordon", b_id)
        assert code == 0, err
        for node in cluster:
            await eventually(
                lambda node=node: cordoned_on(node, b_id, False), f"{node.name} sees b back"
            )


async def test_drain_waits_for_in_flight_jobs_then_force_cancels(
    cluster: list[Node], before: set[JobKey]
) -> None:
    # Last in the module: it leaves c drained (cordoned).
    a, b, c = cluster
    c_id = await c.node_id()
    # A long request on c (only c serves only-c: 40 tokens at 20/s = 2 s).
    body = {"model": "only-c", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40}
    url = f"http://127.0.0.1:{a.ports['facade']}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        finishing = asyncio.create_task(session.post(url, json=body))
        await eventually(lambda: _running_on(a, c_id, before), "the job runs on c")
        code, out, _ = await b.cli("node", "drain", c_id, "--timeout", "30s")
        assert code == 0
        assert "drained" in out
        response = await finishing
        assert response.status == 200  # the in-flight job finished
        response.release()
        # A drain that cannot finish in time fails and says what it waits for ...
        await b.cli("node", "uncordon", c_id)
        body["max_tokens"] = 400  # 20 s
        stuck = asyncio.create_task(session.post(url, json=body))
        await eventually(lambda: _running_on(a, c_id, before), "a long job runs on c")
        code, out, _ = await b.cli("node", "drain", c_id, "--timeout", "1s")
        assert code == 1
        assert "timed out; still waiting for 1 job(s)" in out
        # ... and with --force, it cancels what is left.
        code, out, _ = await b.cli("node", "drain", c_id, "--timeout", "1s", "--force")
        assert code == 0, out
        with contextlib.suppress(aiohttp.ClientError):
            (await stuck).release()
    states = {j["id"]: j["state"] for j in await a.jobs() if job_key(j) not in before}
    assert sorted(states.values()) == ["cancelled", "completed"]
    code, out, _ = await b.cli("ops", "--json")
    assert [op["phase"] for op in json.loads(out) if op["kind"] == "drain"] == [
        "succeeded",
        "failed",
        "succeeded",
    ][::-1]


async def _running_on(node: Node, target: str, before: set[JobKey]) -> bool:
    jobs = [j for j in await node.jobs() if job_key(j) not in before]
    return any(j["state"] == "running" and j.get("scheduledOn") == target for j in jobs)


async def test_a_body_too_deep_or_too_big_is_an_openai_error_and_no_job(
    cluster: list[Node], before: set[JobKey]
) -> None:
    # Nested past the recursion limit was a 500; over 8 MiB was aiohttp's plain-text 413.
    url = f"http://127.0.0.1:{cluster[0].ports['facade']}/v1/chat/completions"
    deep = b'{"model": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big = b'{"model": "llama"}' + b" " * (8 * 1024 * 1024)
    async with aiohttp.ClientSession() as session:
        for body, status in ((deep, 400), (io.BytesIO(big), 413)):
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as response:
                assert response.status == status
                assert (await response.json())["error"]["type"] == "invalid_request_error"
    assert {job_key(j) for j in await cluster[0].jobs()} == before
