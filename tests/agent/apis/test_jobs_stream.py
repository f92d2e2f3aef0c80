"""`GET /v1/jobs/stream` and the Jobs list's counts and filters on a real agent (one per
module): events for every committed job change in order, a reconnect with `Last-Event-ID`
that gets exactly what it missed, `reset` for a point not held, a client that does not keep
up cut while the agent serves on; `/v1/jobs/counts`, the model and requester filters, and
`/v1/usage/series`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.apis.job_feed import JobFeed
from agent.app.daemon import Agent
from tests.agent.apis.test_job_feed import record
from tests.agent.apis.test_local_api import call, event, started_solo
from tests.fixtures.owner import owner
from tests.fixtures.waiting import TIMEOUT_S, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Agent]:
    async with started_solo(tmp_path_factory.mktemp("stream")) as node:
        yield node


def feed_of(agent: Agent) -> JobFeed:
    ui = agent.local_api.ports.ui
    assert ui is not None
    return ui.feed


class Stream:
    """One open `/v1/jobs/stream`, read event by event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self) -> tuple[str, str, Any]:
        """(id, event, data) of the next event; keep-alive comments skipped."""
        fields: dict[str, str] = {}
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                line = (await self.response.content.readline()).decode()
                assert line, "the stream ended"
                line = line.rstrip("\n")
                if not line:
                    if "event" in fields:
                        return fields["id"], fields["event"], json.loads(fields["data"])
                    fields = {}
                    continue
                name, _, value = line.partition(": ")
                if name:
                    fields[name] = value


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def open_stream(
    agent: Agent, client: aiohttp.ClientSession, last: str | None = None
) -> Stream:
    headers = owner(agent.config.home) | ({"Last-Event-ID": last} if last else {})
    response = await client.get(agent.local_api.url + "/v1/jobs/stream", headers=headers)
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    return Stream(response)  # subscribed before its headers were sent: it misses nothing


async def enter(agent: Agent, wid: str, seq: int, state: str, **more: Any) -> None:
    body = event(agent, wid, seq, state)
    body["params"]["workloadInfo"].update(more)
    status, answer = await call(agent, "POST", "/v1/jobs/events", body)
    assert status == 202, answer


async def test_jobs_arrive_in_order_and_a_reconnect_gets_exactly_the_missed(
    agent: Agent, session: aiohttp.ClientSession
) -> None:
    stream = await open_stream(agent, session)
    await enter(agent, "s1", 1, "queued")
    await enter(agent, "s1", 2, "running")
    await enter(agent, "s2", 3, "queued")
    seen = [await stream.next() for _ in range(3)]
    assert [(e, d["id"], d["state"]) for _, e, d in seen] == [
        ("job", "s1", "queued"), ("job", "s1", "running"), ("job", "s2", "queued"),
    ]  # fmt: skip
    _, jobs = await call(agent, "GET", "/v1/jobs?page=1")
    assert seen[1][2] == next(j for j in jobs["jobs"] if j["id"] == "s1")  # as /v1/jobs has it
    stream.response.close()
    await enter(agent, "s2", 4, "running")  # while it is away
    await enter(agent, "s3", 5, "queued")
    again = await open_stream(agent, session, last=seen[2][0])
    await enter(agent, "s3", 6, "running")
    missed = [await again.next() for _ in range(3)]
    assert [(d["id"], d["seq"]) for _, _, d in missed] == [("s2", 4), ("s3", 5), ("s3", 6)]
    ids = [i for i, _, _ in seen + missed]
    assert len(set(ids)) == 6  # no repeat
    again.response.close()


@pytest.mark.parametrize("last", ["another-start-7", "garbage"])
async def test_a_point_not_held_is_a_reset(
    agent: Agent, session: aiohttp.ClientSession, last: str
) -> None:
    stream = await open_stream(agent, session, last=last)
    current, kind, _ = await stream.next()
    assert kind == "reset"
    assert current == feed_of(agent).event_id(feed_of(agent).seq)
    await enter(agent, f"after-{last}", 1, "queued")  # and it follows from there
    _, kind, data = await stream.next()
    assert (kind, data["id"]) == ("job", f"after-{last}")
    stream.response.close()


async def test_a_client_that_does_not_keep_up_is_cut_and_the_agent_serves_on(
    agent: Agent, session: aiohttp.ClientSession
) -> None:
    feed = feed_of(agent)
    before = feed.subscribers
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.local_api.port)
    token = owner(agent.config.home)["Authorization"]
    writer.write(
        f"GET /v1/jobs/stream HTTP/1.1\r\nHost: 127.0.0.1:{agent.local_api.port}\r\n"
        f"Authorization: {token}\r\n\r\n".encode()
    )
    await eventually(lambda: bool(feed.subscribers - before), "the raw stream subscribed")
    (raw,) = feed.subscribers - before
    # More job changes at once than a client's queue holds, never read: the agent cuts it.
    feed.publish([record(f"burst-{n}") for n in range(feed.queue_limit + 10)])
    assert raw.dropped
    async with asyncio.timeout(TIMEOUT_S):
        while await reader.read(65536):
            pass  # what was sent before the cut, then the end of the connection
    writer.close()
    assert raw not in feed.subscribers
    # The control: the agent serves a new stream and its API as before.
    stream = await open_stream(agent, session)
    await enter(agent, "after-cut", 1, "queued")
    assert (await stream.next())[2]["id"] == "after-cut"
    assert (await call(agent, "GET", "/healthz"))[0] == 200
    stream.response.close()


async def test_counts_and_filters_by_model_and_requester(agent: Agent) -> None:
    await enter(agent, "f1", 1, "queued", model="alpha", requesterId="team-a")
    await enter(agent, "f2", 1, "running", model="alpha", requesterId="team-b")
    await enter(agent, "f3", 1, "queued", model="beta", requesterId="team-a")
    status, counts = await call(agent, "GET", "/v1/jobs/counts?model=alpha")
    assert (status, counts) == (200, {"byState": {"queued": 1, "running": 1}, "total": 2})
    _, counts = await call(agent, "GET", "/v1/jobs/counts?requester=team-a&state=queued")
    assert counts == {"byState": {"queued": 2}, "total": 2}
    _, page = await call(agent, "GET", "/v1/jobs?page=1&model=alpha&requester=team-b")
    assert [j["id"] for j in page["jobs"]] == ["f2"]
    _, everything = await call(agent, "GET", "/v1/jobs/counts")
    assert everything["total"] == len(await agent.store.jobs(limit=10_000))
    status, _ = await call(agent, "GET", "/v1/jobs/counts?state=lost")
    assert status == 400


async def test_usage_series_has_its_shape(agent: Agent) -> None:
    status, series = await call(agent, "GET", "/v1/usage/series?window=86400")
    assert status == 200
    assert (series["windowS"], series["bucketS"]) == (86400, 1440)
    assert set(series) >= {"models", "keys", "ttftMs", "latencyMs"}
    assert set(series["ttftMs"]) == {"p50", "p95", "p99"}
    status, _ = await call(agent, "GET", "/v1/usage/series?window=7")
    assert status == 400
