"""Three real agents on 127.0.0.1: pairing over the network, GPUs, the shared Jobs list,
restarts, removal, and the metrics endpoint. Each agent is `python -m agent agent run` with
its own NVPAIR_HOME and ports; every command is the real CLI.

One cluster serves the whole module (three start-ups are most of what these tests cost).
Each test enters jobs under its own id prefix and looks only at those, so none depends on
what another left behind; the one that removes a member comes last. The invite test needs
only the admitting agent, so it gets one of its own.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from certs.invites import Invite, parse_token

from ..harness import Node, eventually, make_node, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("cluster")
    nodes = [
        make_node(root, "a", "h100-80gb-sxm:8"),
        make_node(root, "b", "l4:2"),
        make_node(root, "c", None),  # no GPU: zero devices
    ]
    for node in nodes:
        # A 1 s heartbeat (the default is 2 s): a stopped member is unreachable after 3 s.
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 1.0\n")
    async for started in start_cluster(nodes):
        yield started


@pytest_asyncio.fixture(loop_scope="module")
async def solo(tmp_path: Path) -> AsyncIterator[Node]:
    """One agent: all an invite test needs is the member that admits."""
    async for started in start_cluster([make_node(tmp_path, "a", None)]):
        yield started[0]


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


def jobs_everywhere(
    nodes: list[Node], prefix: str, expected: dict[str, str]
) -> Callable[[], Awaitable[bool]]:
    """A check: every member lists exactly the jobs `expected` names among those whose id
    starts with `prefix` (this test's), each once, in the expected state."""

    async def check() -> bool:
        for node in nodes:
            jobs = [j for j in await node.jobs() if j["id"].startswith(prefix)]
            if {j["id"]: j["state"] for j in jobs} != expected or len(jobs) != len(expected):
                return False
        return True

    return check


async def test_a_job_entered_anywhere_appears_everywhere_once(cluster: list[Node]) -> None:
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    expected: dict[str, str] = {}
    for n, node in enumerate(cluster):
        origin = await node.node_id()
        for seq in (1, 2):
            await node.enter(f"anywhere-{n}", seq, origin)
        expected[f"anywhere-{n}"] = "running"
    await eventually(jobs_everywhere(cluster, "anywhere-", expected), "the same jobs everywhere")
    code, out, _ = await cluster[1].cli("jobs", "--state", "running")
    assert code == 0
    # The CLI lists exactly the running jobs, ours among them.
    assert out.count("running") == len(await cluster[1].get("/v1/jobs?state=running"))
    ours = [line for line in out.splitlines() if line.startswith("anywhere-")]
    assert len(ours) == 3
    assert all("running" in line for line in ours)


async def test_a_debug_log_holds_ours_not_a_line_per_sqlite_statement(
    cluster: list[Node],
) -> None:
    a = cluster[0]
    await a.enter("debug-log", 1, await a.node_id())  # a statement or two in its Jobs store

    async def stored() -> bool:
        return any(job["id"] == "debug-log" for job in await a.jobs())

    await eventually(stored, "the job is stored")
    assert a.log is not None
    text = a.log.read_text()
    assert " DEBUG asyncio: " in text  # the control: the agent logs at debug
    assert " aiosqlite: " not in text  # two lines a statement, its arguments' reprs


async def test_metrics_parse_with_prometheus_own_parser(cluster: list[Node]) -> None:
    a = cluster[0]
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    await a.enter("metrics-1", 1, await a.node_id())
    async with aiohttp.ClientSession() as session, session.get(a.api + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"nvpair_jobs", "nvpair_relay_events_dropped", "nvpair_gpu_memory_total_bytes"} <= set(
        families
    )
    gpu_memory = [s.value for s in families["nvpair_gpu_memory_total_bytes"].samples]
    assert gpu_memory == [80 * 1024**3] * 8
    assert json.dumps(text).count("llama") == 0  # no model names or prompts in metrics labels


async def test_killed_workload_manager_is_restarted_and_catches_up(cluster: list[Node]) -> None:
    a, b, _c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    a_id = await a.node_id()
    await a.enter("killed-1", 1, a_id)
    await eventually(
        jobs_everywhere(cluster, "killed-", {"killed-1": "queued"}), "first job everywhere"
    )
    manager = (await b.get("/healthz"))["manager"]
    os.kill(manager["pid"], signal.SIGKILL)
    await a.enter("killed-1", 2, a_id)
    await a.enter("killed-2", 1, a_id)
    await eventually(
        jobs_everywhere(cluster, "killed-", {"killed-1": "running", "killed-2": "queued"}),
        "b catches up",
    )
    health = await b.get("/healthz")
    assert health["manager"]["restarts"] == 1
    assert health["manager"]["pid"] != manager["pid"]


async def test_a_restarted_agent_restores_its_jobs_and_converges(cluster: list[Node]) -> None:
    a, b, _c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    a_id = await a.node_id()
    await a.enter("restarted-1", 1, a_id)
    await eventually(
        jobs_everywhere(cluster, "restarted-", {"restarted-1": "queued"}), "first job everywhere"
    )
    await b.stop()
    await a.enter("restarted-1", 3, a_id)
    await a.enter("restarted-2", 1, a_id)
    b_id = next(n["nodeId"] for n in await a.get("/v1/nodes") if n["name"] == "b")

    async def b_reachable_on_a(expected: bool) -> bool:
        return any(
            n["nodeId"] == b_id and n["reachable"] is expected for n in await a.get("/v1/nodes")
        )

    await eventually(lambda: b_reachable_on_a(False), "a marks the stopped b unreachable")
    await b.start()
    # straight from disk, before any peer had a word
    assert "restarted-1" in {j["id"] for j in await b.get("/v1/jobs")}
    await eventually(
        jobs_everywhere(
            cluster, "restarted-", {"restarted-1": "completed", "restarted-2": "queued"}
        ),
        "b converges",
    )
    await eventually(lambda: b_reachable_on_a(True), "and reachable again")


async def test_bad_invites_are_refused_over_the_network(solo: Node, tmp_path: Path) -> None:
    a = solo
    stranger = make_node(tmp_path, "d", None)
    code, token, _ = await a.cli("cluster", "invite", "--ttl", "1s")  # the shortest allowed
    expires_at = parse_token(token.strip()).expires_at
    # The invite's own expiry instant, not a guess at how long to sleep.
    await eventually(lambda: time.time() > expires_at, "the one-second invite is past its expiry")
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


async def test_removing_a_member(cluster: list[Node]) -> None:
    # Last in the module: it takes c out of the shared cluster.
    a, b, c = cluster
    await eventually(lambda: all_see_everyone(cluster), "the cluster is up")
    a_id, b_id, c_id = [await node.node_id() for node in cluster]
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
    # And it cannot come back with its stale record: a stays without it after pushes.
    # A record is renewed and pushed when it changes: c cordons itself (a new record of c,
    # pushed to a, which refuses it) and so does b, whose new record arriving on a means a
    # went on merging pushes after c's.
    for node, node_id in ((c, c_id), (b, b_id)):
        code, _, err = await node.cli("node", "cordon", node_id)
        assert code == 0, err

    async def cordons_went_out() -> bool:
        b_on_a = [n for n in await a.get("/v1/nodes") if n["nodeId"] == b_id]
        c_on_c = [n for n in await c.get("/v1/nodes") if n["nodeId"] == c_id]
        return bool(b_on_a and b_on_a[0]["cordoned"] and c_on_c and c_on_c[0]["cordoned"])

    await eventually(cordons_went_out, "c's and b's new records went out")
    assert c_id not in {n["nodeId"] for n in await a.get("/v1/nodes")}
    # c's jobs no longer reach a or b: c's workload manager tries a and is refused, while a
    # job entered on b after it (the control) does arrive.
    refused_before = await c.metric("nvpair_broadcast_batches_failed_total", peer=a_id)
    await c.enter("removed-9", 1, c_id)

    async def c_was_refused() -> bool:
        return await c.metric("nvpair_broadcast_batches_failed_total", peer=a_id) > refused_before

    await eventually(c_was_refused, "c's manager tries to send its job to a and is refused")
    await b.enter("removed-control", 1, b_id)

    async def control_arrived() -> bool:
        return "removed-control" in {j["id"] for j in await a.jobs()}

    await eventually(control_arrived, "the control job from b reaches a")
    for node in (a, b):
        assert "removed-9" not in {j["id"] for j in await node.jobs()}
