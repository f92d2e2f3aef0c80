"""One replica across two members on real agents (issue 32), with the mock engine's RPC
worker: `--nodes 2` places a head on one member and a worker part on another; the head
starts once its worker is ready and reaches it through the agents' tunnel over cluster
mTLS (the tunnel's byte counters show the head's weights went there); chat through every
member answers; the worker's engine listens on loopback only; a member that is not the
head's is refused the tunnel; kill -9 of the worker's engine restarts the whole replica,
which serves again."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.cluster.node_client import NodeClient
from certs import ClusterDir
from facts.records import NodeRecord
from tests.fixtures.records import node_record

from ..deploy_harness import engine_cluster, post, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEIGHTS = 3_000_000  # bytes the mock head sends each worker before it serves


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("span")
    async for started in engine_cluster(root, {"a": None, "b": None, "c": None}):
        yield started


async def whole(nodes: list[Node], name: str, *, other_than: str = "") -> list[dict[str, Any]]:
    """The parts of `name`'s one replica once every member sees both ready (and, with
    `other_than`, of another group than that one)."""
    found: list[dict[str, Any]] = []

    async def ready() -> bool:
        nonlocal found
        for node in nodes:
            parts = await replicas(node, name)
            groups = {p.get("group") for p in parts}
            if len(parts) != 2 or len(groups) != 1 or other_than in groups:
                return False
            if any(p["state"] != "ready" for p in parts):
                return False
        found = parts
        return True

    await eventually(
        ready, f"one replica of {name} over two members, ready everywhere", within_s=90
    )
    return found


async def chat(node: Node, model: str) -> int:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        await response.read()
        return response.status


def listeners(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp says them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    found.add(address)
    return found


async def test_one_replica_over_two_members_serves_through_every_member(trio: list[Node]) -> None:
    a, _b, _c = trio
    body = {
        "name": "wide", "engine": "mock", "source": "wide", "gpus": 0, "nodes": 2,
        "args": ["--rpc-weights-bytes", str(WEIGHTS)],
    }  # fmt: skip
    status, made = await post(a, "/v1/deployments", body)
    assert status == 201, made
    parts = await whole(trio, "wide")
    (head,) = [p for p in parts if p["layout"][0][0] == p["nodeId"]]
    (worker,) = [p for p in parts if p is not head]
    assert head["nodeId"] != worker["nodeId"]
    assert [n for n, _ in head["layout"]] == [head["nodeId"], worker["nodeId"]]
    for node in trio:
        for _ in range(3):
            assert await chat(node, "wide") == 200
    # The head's weights went to the worker through the tunnel, and only through it.
    by_id = {await n.node_id(): n for n in trio}
    shown = {p["id"]: p for p in await replicas(by_id[head["nodeId"]], "wide")}
    assert shown[head["id"]]["tunnel"]["sent"] >= WEIGHTS
    shown = {p["id"]: p for p in await replicas(by_id[worker["nodeId"]], "wide")}
    assert shown[worker["id"]]["tunnel"]["sent"] >= WEIGHTS  # what reached its engine
    assert listeners(worker["port"]) == {"0100007F"}  # 127.0.0.1 alone
    head_node = by_id[head["nodeId"]]
    sent = await head_node.metric("nvpair_tunnel_bytes_total", replica=head["id"], direction="sent")
    assert sent >= WEIGHTS
    code, out, err = await head_node.cli("replicas")
    assert code == 0, err
    assert "head 1/2" in out
    assert "worker 2/2" in out
    # /v1/models lists it once; the worker part is no target of its own.
    models = await a.get_facade("/v1/models")
    assert [m["id"] for m in models["data"]].count("wide") == 1


async def test_a_member_that_is_not_the_heads_is_refused_the_tunnel(trio: list[Node]) -> None:
    parts = await whole(trio, "wide")
    (worker,) = [p for p in parts if p["layout"][0][0] != p["nodeId"]]
    by_id = {await n.node_id(): n for n in trio}
    head_id = worker["layout"][0][0]
    (other_id,) = set(by_id) - {head_id, worker["nodeId"]}
    other = by_id[other_id]
    target = by_id[worker["nodeId"]]
    record: NodeRecord = node_record(worker["nodeId"], node_port=target.ports["node"])
    client = NodeClient(ClusterDir(other.home / "cluster"), lambda n: record)
    try:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with client.tunnel(worker["nodeId"], worker["id"]):
                pass
        assert refused.value.status == 403
        # The control: the same call for a replica id that is no part there, refused too --
        # and the head's own tunnel works (the first test's traffic went through it).
        with pytest.raises(aiohttp.WSServerHandshakeError):
            async with client.tunnel(worker["nodeId"], "rep_" + "0" * 26):
                pass
    finally:
        await client.aclose()


async def test_kill_9_of_the_workers_engine_restarts_the_whole_replica(trio: list[Node]) -> None:
    parts = await whole(trio, "wide")
    (worker,) = [p for p in parts if p["layout"][0][0] != p["nodeId"]]
    before = worker["group"]
    pid = worker_pid(worker["port"])
    os.kill(pid, signal.SIGKILL)
    # Both parts stop, and the replica is placed anew: a new group, whole and ready.
    await whole(trio, "wide", other_than=before)
    for node in trio:
        assert await chat(node, "wide") == 200
    code, _, err = await trio[0].cli("undeploy", "wide")
    assert code == 0, err


def worker_pid(port: int, program: bytes = b"mock-rpc-worker") -> int:
    """The process whose command line names `program` and `port` (a worker part's engine)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(program) for a in argv) and str(port).encode() in argv:
            return int(entry)
    raise AssertionError(f"no {program.decode()} on port {port}")
