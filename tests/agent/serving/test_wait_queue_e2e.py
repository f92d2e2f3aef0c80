"""Wait instead of refusing (issue 15, item 4), on two real agents and a real mock engine.

a runs the engine with `queue_limit = 4` (capacity for 4) and a long wait line; b has no
engine, a line of 2 and a 3 s wait, so its requests are forwarded to a and wait at b. One
cluster serves the module; each test counts only the jobs it made (`before`). Both trace
their requests (issue 31): a request that waited has a span of its wait, and one whose wait
ran out says why.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.otlp import Received, Receiver

from ..harness import (
    Engine,
    JobKey,
    Node,
    eventually,
    job_key,
    make_node,
    module_engine,
    settled_jobs,
    start_cluster,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "waiter"
TOKENS_PER_S = 20  # a request of N tokens runs N / 20 s


engine = module_engine(MODEL, "--tokens-per-s", str(TOKENS_PER_S))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver.running() as started:
        yield started


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine, receiver: Receiver
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("wait")
    a, b = make_node(root, "a", "l4:1"), make_node(root, "b", "l4:1")
    a.extra = ["--engine", f"vllm={engine.url}"]
    for node, settings in (
        (a, "queue_limit = 4\nwait_queue = 16\nwait_timeout_s = 30\n"),
        (b, "wait_queue = 2\nwait_timeout_s = 3\n"),
    ):
        node.home.mkdir(parents=True)
        traced = f'[tracing]\notlp_endpoint = "{receiver.url}"\n'
        (node.home / "nvpair.toml").write_text("[agent]\n" + settings + traced)
        node.extra_env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    async for started in start_cluster([a, b]):

        async def b_sees_the_engine() -> bool:
            data = (await b.get_facade("/v1/models"))["data"]
            return any(m["id"] == MODEL for m in data)

        await eventually(b_sees_the_engine, "b knows a serves the model")
        IDLE[b.name] = await score_of_a(b)  # nothing has run yet: a's score when idle
        yield started


IDLE: dict[str, float] = {}


async def explain(node: Node) -> Any:
    """`node`'s scheduler on the model: a's score, or why a is refused."""
    return await node.get(f"/v1/explain?model={MODEL}")


async def score_of_a(node: Node) -> float:
    """How `node`'s scheduler scores a (its pending work lowers the score)."""
    ranked = (await explain(node))["ranked"]
    return float(ranked[0]["score"]) if ranked else float("-inf")


@pytest_asyncio.fixture(loop_scope="module")
async def before(cluster: list[Node]) -> set[JobKey]:
    """Earlier tests' jobs (`harness.settled_jobs`), once b's scheduler sees a idle too."""
    keys = await settled_jobs(cluster)

    async def b_sees_a_idle() -> bool:
        # b re-reads others' pending work every 0.5 s: until then a still looks busy.
        return await score_of_a(cluster[1]) == IDLE["b"]

    await eventually(b_sees_a_idle, "b's scheduler sees a idle")
    return keys


async def chat(
    session: aiohttp.ClientSession, node: Node, tokens: int
) -> tuple[int, str | None, Any]:
    """One request: (status, Retry-After, decoded body)."""
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    async with session.post(url, json=body) as response:
        return response.status, response.headers.get("Retry-After"), await response.json()


async def new_jobs(node: Node, before: set[JobKey]) -> list[Any]:
    return [j for j in await node.jobs() if job_key(j) not in before]


async def test_twelve_for_capacity_four_all_complete_in_fifo_order(
    cluster: list[Node], before: set[JobKey], receiver: Receiver
) -> None:
    a, b = cluster
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sent = []
        for n in range(12):
            # In a known order: each is a job (running or queued) before the next is sent.
            sent.append(asyncio.create_task(chat(session, a, 10)))

            async def seen(n: int = n) -> bool:
                return len(await new_jobs(a, before)) == n + 1

            await eventually(seen, f"request {n + 1} is a job")
        last = max(int(j["id"]) for j in await new_jobs(a, before))

        async def b_shows_the_last_queued() -> bool:
            jobs = await new_jobs(b, before)
            return any(int(j["id"]) == last and j["state"] == "queued" for j in jobs)

        await eventually(b_shows_the_last_queued, "the 12th job queued on b too", within_s=10)
        answers = await asyncio.gather(*sent)
    assert [status for status, _, _ in answers] == [200] * 12  # none 429: the line held them
    jobs = sorted(await a.get_settled_jobs(12, since=before), key=lambda j: int(j["id"]))
    assert [j["state"] for j in jobs] == ["completed"] * 12
    started = [j["startedAt"] for j in jobs]
    assert started == sorted(started), "a later request started before an earlier one"
    # They waited: the last four cannot have started before the first four finished.
    assert min(j["startedAt"] for j in jobs[8:]) >= min(j["completedAt"] for j in jobs[:4])

    # ... and their traces say so: a span of the wait in each waiting request's trace, none in
    # those that ran at once (the first four).
    ids = {j["id"] for j in jobs}

    def requests() -> dict[str, Received]:
        return {
            str(s.attributes["nvpair.job.id"]): s
            for s in receiver.spans
            if s.name == "POST /v1/chat/completions" and s.attributes.get("nvpair.job.id") in ids
        }

    await eventually(lambda: len(requests()) == 12, "the twelve requests' spans")
    waits = {s.trace_id: s for s in receiver.spans if s.name == "nvpair.wait"}
    waited = {j["id"] for j in jobs[8:]}  # the last four surely waited
    for job_id, request in requests().items():
        wait = waits.get(request.trace_id)
        if job_id in waited:
            assert wait is not None, job_id
            assert wait.parent_id == request.span_id, job_id
            assert "nvpair.wait.refusal" not in wait.attributes
        elif int(job_id) <= int(jobs[0]["id"]) + 3:
            assert wait is None, job_id  # the control: ran at once, no wait


async def test_a_line_of_two_refuses_the_rest_with_retry_after(
    cluster: list[Node], before: set[JobKey]
) -> None:
    _, b = cluster
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(chat(session, b, 10) for _ in range(8)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200] * 6 + [429] * 2  # 4 run, 2 wait and run, 2 find the line full
    for status, retry_after, body in answers:
        if status == 429:
            assert retry_after == "1"
            assert body["error"]["type"] == "rate_limit_error"
    # Refused at once is no job; the six that ran are.
    jobs = await b.get_settled_jobs(6, since=before)
    assert [j["state"] for j in jobs] == ["completed"] * 6


async def test_hanging_up_while_queued_cancels_and_a_wait_that_runs_out_is_429(
    cluster: list[Node], before: set[JobKey], receiver: Receiver
) -> None:
    a, b = cluster
    # Four long requests through a fill its capacity.
    long_session = aiohttp.ClientSession()
    long_ones = [asyncio.create_task(chat(long_session, a, 400)) for _ in range(4)]
    try:

        async def b_sees_a_full() -> bool:
            refused = (await explain(b))["refused"]
            return "queue full" in [r["reason"] for r in refused]  # a's; b serves nothing

        await eventually(b_sees_a_full, "b's scheduler sees a full")
        async with aiohttp.ClientSession() as leaving:
            hang_up = asyncio.create_task(chat(leaving, b, 10))

            async def queued_on_b() -> bool:
                return any(j["state"] == "queued" for j in await new_jobs(b, before))

            await eventually(queued_on_b, "the request waits on b")
            hang_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hang_up
        # The control: one that stays waits its 3 s out, then 429 with Retry-After.
        async with aiohttp.ClientSession() as staying:
            status, retry_after, body = await chat(staying, b, 10)
        assert (status, retry_after) == (429, "1")
        assert "busy" in body["error"]["message"]
    finally:
        for task in long_ones:
            task.cancel()
        await long_session.close()

    async def ended_everywhere() -> bool:
        views = []
        for node in cluster:
            never_started = [j for j in await new_jobs(node, before) if not j.get("startedAt")]
            views.append(sorted((j["state"], j.get("error")) for j in never_started))
        return views == [ENDED, ENDED]

    await eventually(ended_everywhere, "a cancelled and a timed-out job on both members")

    # The one whose wait ran out: its trace says why, in our words.
    (timed_out,) = [j for j in await new_jobs(b, before) if j["state"] == "failed"]

    def its_spans() -> dict[str, Received]:
        request = [
            s
            for s in receiver.spans
            if s.name == "POST /v1/chat/completions"
            and s.attributes.get("nvpair.job.id") == timed_out["id"]
            and s.attributes.get("nvpair.job.run_id") == timed_out["runId"]
        ]
        return {s.name: s for s in receiver.spans if request and s.trace_id == request[0].trace_id}

    await eventually(lambda: "nvpair.wait" in its_spans(), "the timed-out request's wait span")
    spans = its_spans()
    assert spans["nvpair.wait"].attributes["nvpair.wait.refusal"]
    request = spans["POST /v1/chat/completions"]
    assert request.error == "waited too long for capacity"
    assert request.attributes["http.response.status_code"] == 429


ENDED: Final = [
    ("cancelled", "cancelled: client disconnected or node drained"),
    ("failed", "waited too long for capacity"),
]
