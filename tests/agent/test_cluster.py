"""Three real agents on 127.0.0.1: pairing over the network, GPUs, the shared Jobs list,
restarts, removal, and the metrics endpoint. Each agent is `python -m agent agent run` with
its own NVPAIR_HOME and ports; every command is the real CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from certs.invites import Invite, parse_token

from .harness import Node, eventually, make_node, start_cluster


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[list[Node]]:
    nodes = [
        make_node(tmp_path, "a", "h100-80gb-sxm:8"),
        make_node(tmp_path, "b", "l4:2"),
        make_node(tmp_path, "c", None),  # no GPU: zero devices
    ]
    async for started in start_cluster(nodes):
        yield started


async def all_see_everyone(nodes: list[Node]) -> bool:
    for node in nodes:
        listed = await node.get("/v1/nodes")
        if len(listed) != 3 or not all(n["reachable"] for n in listed):
            return False
    return True


async def test_three_members_see_each_other_and_their_gpus(cluster: list[Node]) -> None:
    start = time.monotonic()
    await eventually(lambda: all_see_everyone(cluster), "three reachable members everywhere")
    assert time.monotonic() - start < 5.0
    for node in cluster:
        listed = {n["name"]: n for n in await node.get("/v1/nodes")}
        assert [d["deviceClass"] for d in listed["a"]["devices"]] == ["h100-80gb-sxm"] * 8
        assert [d["deviceClass"] for d in listed["b"]["devices"]] == ["l4"] * 2
        assert listed["c"]["devices"] == []
        assert listed["c"]["gpuNote"]  # says why there are none
        assert len(await node.get("/v1/members")) == 3
    code, out, _ = await cluster[0].cli("nodes")
    assert code == 0
    assert "h100-80gb-sxm" in out


async def jobs_everywhere(nodes: list[Node], expected: dict[str, str]) -> bool:
    for node in nodes:
        jobs = await node.get("/v1/jobs")
        if {j["id"]: j["state"] for j in jobs} != expected or len(jobs) != len(expected):
            return False
    return True


async def test_a_job_entered_anywhere_appears_everywhere_once(cluster: list[Node]) -> None:
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    expected: dict[str, str] = {}
    for n, node in enumerate(cluster):
        origin = await node.node_id()
        for seq in (1, 2):
            await node.enter(str(n), seq, origin)
        expected[str(n)] = "running"
    await eventually(lambda: jobs_everywhere(cluster, expected), "the same jobs everywhere")
    code, out, _ = await cluster[1].cli("jobs", "--state", "running")
    assert code == 0
    assert out.count("running") == 3


async def test_killed_workload_manager_is_restarted_and_catches_up(cluster: list[Node]) -> None:
    a, b, _c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    a_id = await a.node_id()
    await a.enter("1", 1, a_id)
    await eventually(lambda: jobs_everywhere(cluster, {"1": "queued"}), "first job everywhere")
    manager = (await b.get("/healthz"))["manager"]
    os.kill(manager["pid"], signal.SIGKILL)
    await a.enter("1", 2, a_id)
    await a.enter("2", 1, a_id)
    await eventually(
        lambda: jobs_everywhere(cluster, {"1": "running", "2": "queued"}), "b catches up"
    )
    health = await b.get("/healthz")
    assert health["manager"]["restarts"] == 1
    assert health["manager"]["pid"] != manager["pid"]


async def test_a_restarted_agent_restores_its_jobs_and_converges(cluster: list[Node]) -> None:
    a, b, _c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    a_id = await a.node_id()
    await a.enter("1", 1, a_id)
    await eventually(lambda: jobs_everywhere(cluster, {"1": "queued"}), "first job everywhere")
    await b.stop()
    await a.enter("1", 3, a_id)
    await a.enter("2", 1, a_id)
    b_id = next(n["nodeId"] for n in await a.get("/v1/nodes") if n["name"] == "b")

    async def b_reachable_on_a(expected: bool) -> bool:
        return any(
            n["nodeId"] == b_id and n["reachable"] is expected for n in await a.get("/v1/nodes")
        )

    await eventually(lambda: b_reachable_on_a(False), "a marks the stopped b unreachable")
    await b.start()
    # straight from disk, before any peer had a word
    assert "1" in {j["id"] for j in await b.get("/v1/jobs")}
    await eventually(
        lambda: jobs_everywhere(cluster, {"1": "completed", "2": "queued"}), "b converges"
    )
    await eventually(lambda: b_reachable_on_a(True), "and reachable again")


async def test_removing_a_member(cluster: list[Node]) -> None:
    a, b, c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    c_id = await c.node_id()
    code, _out, err = await a.cli("cluster", "remove", c_id)
    assert code == 0, err

    async def gone() -> bool:
        for node in (a, b):
            if any(n["nodeId"] == c_id for n in await node.get("/v1/nodes")):
                return False
            removed = [m for m in await node.get("/v1/members") if m["nodeId"] == c_id]
            if not removed or removed[0]["removed"] is None:
                return False
        return True

    await eventually(gone, "c leaves every member's list")
    # c's own requests are refused with 403 on a and b
    from certs import ClientContexts, ClusterDir, server_hostname_for

    connector = aiohttp.TCPConnector(ssl=ClientContexts(ClusterDir(c.home / "cluster")).current())
    async with aiohttp.ClientSession(connector=connector) as session:
        for node in (a, b):
            node_id = await node.node_id()
            async with session.post(
                f"https://127.0.0.1:{node.ports['node']}/v1/records",
                json={"records": [], "removals": [], "certificates": []},
                server_hostname=server_hostname_for(node_id),
            ) as response:
                assert response.status == 403
    # and it cannot come back with its stale record: a stays without it after heartbeats
    await asyncio.sleep(3)
    assert c_id not in {n["nodeId"] for n in await a.get("/v1/nodes")}
    c_origin = c_id
    await c.enter("9", 1, c_origin)
    await asyncio.sleep(2)
    assert "9" not in {j["id"] for j in await a.get("/v1/jobs")}


async def test_bad_invites_are_refused_over_the_network(
    cluster: list[Node], tmp_path: Path
) -> None:
    a = cluster[0]
    stranger = make_node(tmp_path, "d", None)
    code, token, _ = await a.cli("cluster", "invite", "--ttl", "1s")
    await asyncio.sleep(1.5)
    code, _, err = await stranger.cli(
        "cluster", "join", f"127.0.0.1:{a.ports['node']}", token.strip()
    )
    assert code == 1
    assert "invite expired" in err
    code, token, _ = await a.cli("cluster", "invite")
    real = parse_token(token.strip())
    forged = Invite(real.ca_fingerprint, real.invite_id, bytes(32), real.expires_at).token()
    code, _, err = await stranger.cli("cluster", "join", f"127.0.0.1:{a.ports['node']}", forged)
    assert code == 1
    assert "secret does not match" in err
    code, _, err = await stranger.cli(
        "cluster", "join", f"127.0.0.1:{a.ports['node']}", token.strip()
    )
    assert code == 0, err
    other = make_node(tmp_path, "e", None)
    code, _, err = await other.cli("cluster", "join", f"127.0.0.1:{a.ports['node']}", token.strip())
    assert code == 1
    assert "already used" in err


async def test_metrics_parse_with_prometheus_own_parser(cluster: list[Node]) -> None:
    a = cluster[0]
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    await a.enter("1", 1, await a.node_id())
    async with aiohttp.ClientSession() as session, session.get(a.api + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"nvpair_jobs", "nvpair_relay_duplicates", "nvpair_gpu_memory_total_bytes"} <= set(
        families
    )
    gpu_memory = [s.value for s in families["nvpair_gpu_memory_total_bytes"].samples]
    assert gpu_memory == [80 * 1024**3] * 8
    assert json.dumps(text).count("llama") == 0  # no model names or prompts in metrics labels
