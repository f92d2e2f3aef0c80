"""A deployment's own cold-start timeout on a real agent (issue 30): the member's wait line
gives up after `wait_timeout_s` (1 s here), but an engine that loads for 3 s can still serve
a request sent while it is at zero when its deployment says how long a cold start may take
(`coldStartS`, `nvpair deploy --cold-start-timeout`). The control, the same deployment
without it, answers 429 when the line's own second runs out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, post
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def solo(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    root = tmp_path_factory.mktemp("cold")
    async for (started,) in engine_cluster(root, {"a": None}, agent_toml="wait_timeout_s = 1\n"):
        yield started


async def test_a_cold_start_waits_as_long_as_its_deployment_says(solo: Node) -> None:
    a = solo
    slow = {"engine": "mock", "gpus": 0, "args": ["--startup-s", "3"]}
    bounds = {"minReplicas": 0, "maxReplicas": 1, "idleToZeroS": 600, "scaleDownAfterS": 600}
    for name, extra in (("patient", {"coldStartS": 60}), ("plain", {})):
        status, text = await post(a, "/v1/deployments", slow | bounds | {"name": name} | extra)
        assert status == 201, text
    url = f"http://127.0.0.1:{a.ports['facade']}/v1"

    async def listed() -> bool:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/models") as answer:
            return {"patient", "plain"} <= {m["id"] for m in (await answer.json())["data"]}

    await eventually(listed, "both listed at zero")

    async def ask(session: aiohttp.ClientSession, model: str) -> tuple[int, str]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{url}/chat/completions", json=body) as answer:
            return answer.status, await answer.text()

    async with aiohttp.ClientSession() as session:
        (patient, said), (plain, refused) = await asyncio.gather(
            ask(session, "patient"), ask(session, "plain")
        )
    assert (plain, patient) == (429, 200), (refused, said)
    assert json.loads(said)["model"] == "patient"
    assert "stayed busy for 1s" in json.loads(refused)["error"]["message"]
    jobs = {j["model"]: j for j in await a.get_settled_jobs(2)}
    assert (jobs["patient"]["state"], jobs["plain"]["state"]) == ("completed", "failed")
    for name in ("patient", "plain"):
        code, _, err = await a.cli("undeploy", name)
        assert code == 0, err
