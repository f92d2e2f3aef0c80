"""Deployments across real agents (issue 13, item 1): declared on one member they reach
every member and outlive restarts; concurrent edits at two members converge to one version
everywhere; bad declarations get a clear 400 or 404 and change nothing. The three agents
share one engine port range, as three started on one host without configuration do: each
replica's engine still gets its own port, and serves there (issue 25, item 4)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.engines.ports import check_port

from ..deploy_harness import engine_cluster, engine_pids, ready_everywhere, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    # Members without GPUs run the gpus-0 mock deployments below: `engine_cluster` gives
    # them one range of this worker's engine ports and kills the engines at the end (agents
    # leave them running when they stop, for the next start to adopt).
    root = tmp_path_factory.mktemp("deployments")
    async for started in engine_cluster(root, dict.fromkeys("abc"), one_range=True):
        yield started


async def post(node: Node, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(headers=node.owner) as session,
        session.post(node.api + path, json=body) as response,
    ):
        text = await response.text()
        return response.status, (await response.json() if response.status < 300 else text)


async def declared(node: Node) -> dict[str, tuple[int, int, str]]:
    return {
        d["name"]: (d["version"], d["replicas"], d["by"]) for d in await node.get("/v1/deployments")
    }


async def same_everywhere(nodes: list[Node], name: str) -> bool:
    views = [(await declared(n)).get(name) for n in nodes]
    return views[0] is not None and all(v == views[0] for v in views)


async def chat(session: aiohttp.ClientSession, node: Node) -> int:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(url, json=body) as response:
        await response.read()
        return response.status


async def test_three_agents_on_one_port_range_run_three_engines_that_fail_over(
    trio: list[Node],
) -> None:
    # First in the module: every agent's port search starts at the range's first port, so
    # the three engines go for one port at once. Each replica must end on a port its own
    # engine listens on, and be ready only there.
    code, made = await post(trio[0], "/v1/deployments", {"name": "chat", "engine": "mock",
                            "gpus": 0, "replicas": 3, "args": ["--latency-ms", "100"]})  # fmt: skip
    assert code == 201, made
    await eventually(lambda: ready_everywhere(trio, "chat", 3), "three ready replicas", within_s=60)
    seen = {r["id"]: r for r in await replicas(trio[0], "chat")}
    assert sorted(r["node"] for r in seen.values()) == ["a", "b", "c"]
    assert len({r["port"] for r in seen.values()}) == 3
    engines = {rid: pid for node in trio for rid, pid in engine_pids(node.home).items()}
    assert engines.keys() == seen.keys()
    for rid, pid in engines.items():  # the port each record names is its own engine's
        assert check_port(seen[rid]["port"], pid).engines, (rid, seen[rid]["port"], pid)

    statuses: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:  # through every member's facade in turn
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                statuses.extend(await asyncio.gather(*(chat(session, n) for n in trio)))

    driving = asyncio.create_task(load())
    await eventually(lambda: len(statuses) >= 9, "requests flow")
    (rid, pid), = engine_pids(trio[2].home).items()  # fmt: skip
    os.kill(pid, signal.SIGKILL)

    async def restarted() -> bool:
        now = engine_pids(trio[2].home).get(rid)
        return now not in (None, pid) and await ready_everywhere(trio, "chat", 3)

    await eventually(restarted, "c's engine restarted, ready again", within_s=60)
    sent = len(statuses)
    await eventually(lambda: len(statuses) >= sent + 9, "requests after the restart")
    stop.set()
    await driving
    assert statuses.count(200) == len(statuses), statuses  # none failed: failed over
    assert (await post(trio[0], "/v1/deployments/chat/undeploy", {}))[0] == 200


async def test_a_deployment_reaches_every_member_and_outlives_restarts(trio: list[Node]) -> None:
    a, b, c = trio
    code, made = await post(a, "/v1/deployments", {"name": "llama", "engine": "mock", "gpus": 0})
    assert code == 201, made
    assert made["by"] == await a.node_id()
    assert "signature" not in made  # people see no signature
    await eventually(lambda: same_everywhere(trio, "llama"), "every member holds llama")
    await b.stop()
    await b.start()
    assert "llama" in await declared(b)  # from its own file, before any push
    # the CLI lists it too, on another member
    code, out, err = await c.cli("deployments")
    assert code == 0, err
    assert "llama" in out


async def test_bounds_are_declared_shown_and_held_through_the_cli(trio: list[Node]) -> None:
    # Issue 30: `nvpair deploy --min-replicas/--max-replicas ...` as scripts write it.
    a, _, c = trio
    code, out, err = await a.cli(
        "deploy", "lazy", "--model", "m", "--engine", "mock", "--gpus", "0", "--min-replicas",
        "0", "--max-replicas", "2", "--target-waiting", "1", "--scale-down-after", "2m",
        "--idle-to-zero", "10m", "--priority", "7", "--cold-start-timeout", "3m",
    )  # fmt: skip
    assert code == 0, err
    assert "0 replica(s) of 0..2, on load" in out
    await eventually(lambda: same_everywhere(trio, "lazy"), "every member holds lazy")
    (seen,) = [d for d in await c.get("/v1/deployments") if d["name"] == "lazy"]
    assert seen["elastic"] == {
        "min": 0, "max": 2, "targetWaiting": 1.0, "scaleDownAfterS": 120.0,
        "idleToZeroS": 600.0, "reason": "declared", "priority": 7, "coldStartS": 180.0,
    }  # fmt: skip
    code, out, err = await c.cli("deployments")
    assert code == 0, err
    (row,) = [line.split() for line in out.splitlines() if line.startswith("lazy ")]
    assert row[2:7] == ["0", "0", "0", "2", "declared"]  # min, desired, ready, max, why
    code, _, err = await c.cli("scale", "lazy", "3")
    assert code != 0
    assert "between 0 and 2" in err  # beyond its bounds: refused, with how to change them
    code, _, err = await a.cli(
        "deploy", "both", "--model", "m", "--engine", "mock", "--replicas", "2",
        "--max-replicas", "3",
    )  # fmt: skip
    assert code == 2
    assert "--replicas is a fixed count" in err
    code, _, err = await a.cli(
        "deploy", "fixed", "--model", "m", "--engine", "mock", "--priority", "3"
    )  # fmt: skip
    assert code == 2  # a class is for sharing GPUs on load: a fixed count has none
    assert "need --min-replicas or --max-replicas" in err
    code, _, err = await c.cli("undeploy", "lazy")
    assert code == 0, err


async def test_concurrent_edits_converge_to_one_version(trio: list[Node]) -> None:
    a, b, c = trio
    code, _ = await post(a, "/v1/deployments", {"name": "race", "engine": "mock", "gpus": 0})
    assert code == 201
    await eventually(lambda: same_everywhere(trio, "race"), "every member holds race")
    # b and c scale it at the same moment, each from the version it holds
    results = await asyncio.gather(
        post(b, "/v1/deployments/race/scale", {"replicas": 2}),
        post(c, "/v1/deployments/race/scale", {"replicas": 3}),
    )
    assert [code for code, _ in results] == [200, 200]
    await eventually(lambda: same_everywhere(trio, "race"), "one version of race everywhere")
    version, replicas, _ = (await declared(a))["race"]
    assert version >= 2
    assert replicas in (2, 3)


async def test_bad_declarations_are_refused_with_nothing_changed(trio: list[Node]) -> None:
    a = trio[0]
    before = await declared(a)
    for body in (
        {"name": "x"},  # no engine
        {"name": "x", "engine": "mock", "gpus": -1},
        {"name": "x", "engine": "mock", "replicas": "many"},
        {"name": "bad name!", "engine": "mock"},
        {"name": "x", "engine": "mock", "prompt": "secret"},  # an unknown field
        {"name": "x", "engine": "mock", "authority": "observed"},  # observed needs a url
    ):
        code, text = await post(a, "/v1/deployments", body)
        assert code == 400, (body, code, text)
    code, _ = await post(a, "/v1/deployments/nothing-here/scale", {"replicas": 1})
    assert code == 404
    code, _ = await post(a, "/v1/deployments/llama/scale", {"replicas": 99999})
    assert code == 400
    assert await declared(a) == before
    # The control: a good one after them is taken.
    assert (await post(a, "/v1/deployments", {"name": "x", "engine": "mock", "gpus": 0}))[0] == 201


async def test_undeploy_holds_everywhere(trio: list[Node]) -> None:
    a, b, _ = trio
    code, out = await post(b, "/v1/deployments/llama/undeploy", {})
    assert code == 200, out

    async def gone() -> bool:
        return all(["llama" not in await declared(n) for n in trio])

    await eventually(gone, "llama is undeployed on every member")
    await a.stop()
    await a.start()  # a late push of an older version cannot bring it back
    await eventually(lambda: same_everywhere(trio, "race"), "a is back in the cluster")
    assert "llama" not in await declared(a)
