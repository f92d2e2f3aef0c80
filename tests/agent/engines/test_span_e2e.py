"""One replica across two members on real agents (issue 32), with the mock engine's RPC
worker: `--nodes 2` places a head on one member and a worker part on another; the head
starts once its worker is ready and reaches it through the agents' tunnel over cluster
mTLS (the tunnel's byte counters show the head's weights went there); chat through every
member answers; the worker's engine listens on loopback only; a member that is not the
head's is refused the tunnel; kill -9 of the worker's engine restarts the whole replica,
which serves again, and so does a restart of the head's agent (its tunnels end with it).
With simulated GPUs -- two members of 8 H100s and one with 2 free -- an
SGLang deployment of 2 x 4 GPUs per replica lands on the two with room, never on the one
with 2; a third replica that fits nowhere is explained; SGLang's parts talk NCCL over the
network, so a member that has not said the network is trusted refuses the deployment, and
its parts placed on such members hold their GPUs and wait, saying why."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from agent.cluster.node_client import NodeClient
from agent.engines.parts import UNTRUSTED
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
    # 8 simulated H100s each (the mock's parts need none); c alone says its network is
    # trusted: an engine whose parts talk NCCL is declared there (a member that does not say
    # so refuses it), and its parts, placed on a and b, wait.
    gpus = dict.fromkeys("abc", "h100-80gb-sxm:8")
    trusted = {"c": "trusted_network = true"}
    async for started in engine_cluster(root, gpus, engines_toml=trusted):
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


async def test_the_heads_agent_restarted_restarts_the_replica_whole(trio: list[Node]) -> None:
    # The head's engine reaches its worker through its agent's tunnels, which end with that
    # agent: the agent that comes back (and re-adopts its engines) restarts the replica.
    parts = await whole(trio, "wide")
    (head,) = [p for p in parts if p["layout"][0][0] == p["nodeId"]]
    by_id = {await n.node_id(): n for n in trio}
    member = by_id[head["nodeId"]]
    await member.stop()
    await member.start()
    await whole(trio, "wide", other_than=head["group"])
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


# -- placement with simulated GPUs, and the network that nvpair does not carry ------------------


async def parts_of(node: Node, name: str, count: int) -> list[dict[str, Any]] | None:
    seen = await replicas(node, name)
    return seen if len(seen) == count else None


async def has(node: Node, name: str, count: int) -> bool:
    return await parts_of(node, name, count) is not None


async def test_two_by_four_lands_on_the_members_with_room_never_on_one_with_two(
    trio: list[Node],
) -> None:
    a, b, c = trio
    c_id = await c.node_id()
    # c keeps 6 of its 8 GPUs busy: 2 free there.
    busy = {
        "name": "busy",
        "engine": "mock",
        "source": "busy",
        "gpus": 6,
        "constraints": {"node": "c"},
    }
    status, made = await post(a, "/v1/deployments", busy)
    assert status == 201, made
    await eventually(lambda: has(a, "busy", 1), "c's busy replica in a's view")
    wide = {
        "name": "big", "engine": "sglang", "source": "/models/big", "gpus": 4, "nodes": 2,
        "replicas": 2, "constraints": {"oneDomain": True},
    }  # fmt: skip
    status, made = await post(a, "/v1/deployments", wide)
    assert status == 400, made  # a does not say the network is trusted
    assert "trusted_network" in made
    status, made = await post(c, "/v1/deployments", wide)
    assert status == 201, made
    found: list[dict[str, Any]] = []

    async def placed() -> bool:
        nonlocal found
        seen = await parts_of(b, "big", 4)
        found = seen or []
        return seen is not None and all(p.get("error") == UNTRUSTED[:256] for p in seen)

    await eventually(placed, "two replicas of two parts, each waiting for a trusted network")
    assert c_id not in {p["nodeId"] for p in found}  # never on the member with 2 free
    assert all(len(p["devices"]) == 4 for p in found)
    groups: dict[str, set[str]] = {}
    for p in found:
        groups.setdefault(p["group"], set()).add(p["nodeId"])
    assert len(groups) == 2
    assert all(len(members) == 2 for members in groups.values())  # each over both members
    # A third replica fits nowhere: a and b are full, c has 2 free.
    code, _, err = await a.cli("scale", "big", "3")
    assert code == 0, err

    async def explained() -> str:
        answer = await a.get("/v1/deployments/big/explain")
        return " ".join(answer["unplaced"])

    await eventually(lambda: _says(explained, "spans 2 members"), "the third replica explained")
    why = await explained()
    assert "2 free healthy" in why  # c's
    assert len(await replicas(a, "big")) == 4  # nothing partial placed for it
    for name in ("big", "busy"):
        code, _, err = await a.cli("undeploy", name)
        assert code == 0, err


async def _says(read: Any, text: str) -> bool:
    return text in await read()
