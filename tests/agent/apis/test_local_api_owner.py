"""The local API answers only its owner (issue 12, item 4), on one agent shared by the module:
without the token, from a foreign Host (DNS rebinding), from a cross-site page, or with a
form or `text/plain` body, nothing is done -- each refusal followed by the same call made as
the owner, which is taken."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.apis.local_guard import TOKEN_FILE, issue_token, read_token, refusal
from agent.app.daemon import Agent
from tests.agent.apis.test_local_api import call, event, started_solo
from tests.fixtures.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

READS = ["/v1/jobs", "/v1/nodes", "/v1/members", "/v1/manager", "/v1/ops", "/v1/explain?model=m"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Agent]:
    async with started_solo(tmp_path_factory.mktemp("owner")) as node:
        yield node


async def listed(agent: Agent) -> list[str]:
    status, jobs = await call(agent, "GET", "/v1/jobs")
    assert status == 200, jobs
    return sorted(j["id"] for j in jobs)


async def raw(agent: Agent, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    """A request with exactly the headers given (no token unless one is among them)."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, agent.local_api.url + path, **kwargs) as response,
    ):
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def bearer(agent: Agent) -> dict[str, str]:
    return {"Authorization": f"Bearer {read_token(agent.config.home)}"}


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Bearer ", "Basic {token}", "{token}", "Bearer {token}x", "Bearer é"],
)
async def test_without_the_token_nothing_is_done(agent: Agent, authorization: str | None) -> None:
    token = read_token(agent.config.home)
    headers = {} if authorization is None else {"Authorization": authorization.format(token=token)}
    wid = f"no-token-{abs(hash(authorization))}"
    body = event(agent, wid, 1, "queued")
    status, answer = await raw(agent, "POST", "/v1/jobs/events", json=body, headers=headers)
    assert (status, "Authorization: Bearer" in answer["error"]) == (401, True)
    cordon = {"kind": "cordon", "target": agent.node_id}
    assert (await raw(agent, "POST", "/v1/ops", json=cordon, headers=headers))[0] == 401
    remove = f"/v1/members/{agent.node_id}/remove"
    assert (await raw(agent, "POST", remove, headers=headers))[0] == 401
    for path in READS:
        assert (await raw(agent, "GET", path, headers=headers))[0] == 401, path
    assert wid not in await listed(agent)
    assert (await call(agent, "GET", "/v1/ops"))[1] == []  # no cordon was started
    # The control: the same event with the token is taken and listed.
    assert (await raw(agent, "POST", "/v1/jobs/events", json=body, headers=bearer(agent)))[0] == 202
    assert wid in await listed(agent)
    for path in READS:
        assert (await raw(agent, "GET", path, headers=bearer(agent)))[0] == 200, path


async def test_health_and_metrics_need_no_token(agent: Agent) -> None:
    status, health = await raw(agent, "GET", "/healthz")
    assert (status, health["nodeId"]) == (200, agent.node_id)
    status, metrics = await raw(agent, "GET", "/metrics")
    assert (status, "nvpair_jobs" in metrics) == (200, True)


@pytest.mark.parametrize(
    "host", ["evil.example:{port}", "127.0.0.1:1", "localhost", "127.0.0.1.evil.example:{port}"]
)
async def test_a_foreign_host_is_refused(agent: Agent, host: str) -> None:
    # DNS rebinding: the page's own name now resolves to 127.0.0.1; its Host stays foreign.
    foreign = {**bearer(agent), "Host": host.format(port=agent.local_api.port)}
    wid = f"rebound-{abs(hash(host))}"
    body = event(agent, wid, 1, "queued")
    status, answer = await raw(agent, "POST", "/v1/jobs/events", json=body, headers=foreign)
    assert (status, "is not this agent's local API" in answer["error"]) == (403, True)
    assert (await raw(agent, "GET", "/healthz", headers=foreign))[0] == 403  # not its node id
    assert wid not in await listed(agent)
    # The control: the names of loopback itself, with the token.
    for name in ("localhost", "[::1]", "LOCALHOST"):
        own = {**bearer(agent), "Host": f"{name}:{agent.local_api.port}"}
        assert (await raw(agent, "POST", "/v1/jobs/events", json=body, headers=own))[0] == 202
    assert wid in await listed(agent)


@pytest.mark.parametrize(
    "origin", ["https://evil.example", "null", "http://127.0.0.1:1", "http://localhost"]
)
async def test_a_cross_site_origin_is_refused(agent: Agent, origin: str) -> None:
    # Even holding the token (a page that learnt it cannot use it from its own origin).
    cross = {**bearer(agent), "Origin": origin}
    cordon = {"kind": "cordon", "target": agent.node_id, "reason": origin}
    status, answer = await raw(agent, "POST", "/v1/ops", json=cordon, headers=cross)
    assert (status, "refused" in answer["error"]) == (403, True)
    assert [op["reason"] for op in (await call(agent, "GET", "/v1/ops"))[1]].count(origin) == 0
    # The control: the API's own origin, and no Origin at all (the CLI, curl).
    own = {**bearer(agent), "Origin": f"http://127.0.0.1:{agent.local_api.port}"}
    uncordon = {"kind": "uncordon", "target": agent.node_id, "reason": origin}
    assert (await raw(agent, "POST", "/v1/ops", json=uncordon, headers=own))[0] == 200
    assert (await raw(agent, "POST", "/v1/ops", json=uncordon, headers=bearer(agent)))[0] == 200

    async def both_listed() -> bool:
        ops = (await call(agent, "GET", "/v1/ops"))[1]
        return [op["reason"] for op in ops].count(origin) == 2

    await eventually(both_listed, "the owner's two operations")


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("text/plain", '{{"method": "workload:submitted", "params": {params}}}'),
        ("application/x-www-form-urlencoded", "method=workload%3Asubmitted&params={params}"),
        ("multipart/form-data; boundary=x", '--x\r\nContent-Disposition: form-data; name="a"'),
        (None, '{{"method": "workload:submitted", "params": {params}}}'),
    ],
)
async def test_a_body_that_is_not_json_is_415(
    agent: Agent, content_type: str | None, data: str
) -> None:
    wid = f"form-{(content_type or 'none')[:12]}"
    body = event(agent, wid, 1, "queued")
    text = data.format(params=str(body["params"]).replace("'", '"').replace("None", "null"))
    headers = bearer(agent) | ({} if content_type is None else {"Content-Type": content_type})
    post = await raw(agent, "POST", "/v1/jobs/events", data=text.encode(), headers=headers)
    assert post[0] == 415, post
    assert wid not in await listed(agent)
    # The control: the same bytes, said to be JSON (a charset is fine), are taken.
    json_type = {**bearer(agent), "Content-Type": "Application/JSON; charset=utf-8"}
    if content_type in ("text/plain", None):
        taken = await raw(agent, "POST", "/v1/jobs/events", data=text.encode(), headers=json_type)
        assert taken[0] == 202, taken
        assert wid in await listed(agent)


async def test_the_token_file_is_the_owners_alone(agent: Agent) -> None:
    path = agent.config.home / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_token(agent.config.home)) >= 40  # 32 random bytes, base64url


async def test_each_start_issues_a_fresh_private_token(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        first, second = issue_token(tmp_path), issue_token(tmp_path)
    finally:
        os.umask(old)
    assert first != second
    assert read_token(tmp_path) == second
    assert stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode) == 0o600


async def test_the_decision_alone() -> None:
    def decide(**headers: str) -> int | None:
        named = {k.replace("_", "-").title(): v for k, v in headers.items()}
        answer = refusal("GET", "/v1/jobs", named, has_body=False, port=14322, token="t")
        return None if answer is None else answer[0]

    assert decide(host="127.0.0.1:14322", authorization="Bearer t") is None
    assert decide(host="127.0.0.1:14322", authorization="bearer  t") is None
    assert decide(authorization="Bearer t") == 403  # no Host at all
    assert decide(host="127.0.0.1:14322", authorization="Bearer \udcff") == 401  # never raises
    assert (
        decide(host="127.0.0.1:14322", origin="http://[::1]:14322", authorization="Bearer t")
        is None
    )
