"""Jobs in another member's name (issue 25, item 2), on two real agents that repair every
half second: a's owner cannot enter an event in b's name (400, and it reaches nobody); a
row in b's name that b never made, held by a, is never taken by b; and a b that lost its
`jobs.db` altogether still gets its own rows back -- those of the runs it recorded."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from broker.jobs import JobsStore, JobsWriter
from tests.agent.harness import Engine, Node, eventually, make_node, start_cluster, start_engine
from tests.fixtures.records import lifecycle_event, workload, workload_record

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine() -> AsyncIterator[Engine]:
    started = await start_engine(MODEL)
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("own-runs")
    nodes = [make_node(root, "a", "l4:1"), make_node(root, "b", "l4:1")]
    for node in nodes:
        node.extra = ["--engine", f"vllm={engine.url}"]
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nanti_entropy_s = 0.5\n")
    async for started in start_cluster(nodes):
        yield started


async def post_event(node: Node, record: dict[str, Any]) -> tuple[int, str]:
    """`POST /v1/jobs/events` as the node's owner: the status and the body."""
    async with (
        aiohttp.ClientSession(headers=node.owner) as session,
        session.post(node.api + "/v1/jobs/events", json=lifecycle_event(record)) as response,
    ):
        return response.status, await response.text()


def now_ms() -> int:
    return int(time.time() * 1000)


async def listed(node: Node, wid: str) -> dict[str, Any] | None:
    """The job with id `wid` in the node's Jobs list, if it is there."""
    return next((j for j in await node.jobs() if j["id"] == wid), None)


async def lists(node: Node, wid: str) -> bool:
    return await listed(node, wid) is not None


def stored(node: Node, text: str) -> bool:
    return any(
        text.encode() in p.read_bytes() for p in node.home.iterdir() if p.name.startswith("jobs.db")
    )


def forget(node: Node, *wids: str) -> None:
    """Delete rows from the node's jobs.db behind the agent's back (a store that lost them)."""
    with sqlite3.connect(node.home / "jobs.db", timeout=5) as raw:
        raw.execute(f"DELETE FROM jobs WHERE id IN ({','.join('?' * len(wids))})", wids)


async def rounds(node: Node) -> float:
    """Anti-entropy rounds this node started (with one peer: all of them with the other)."""
    return await node.metric("nvpair_anti_entropy_rounds")


async def test_an_event_in_another_members_name_is_refused_and_reaches_nobody(
    pair: list[Node],
) -> None:
    a, b = pair
    a_id, b_id = await a.node_id(), await b.node_id()
    forged = workload_record("in-bs-name", 1, origin=b_id, run="planted-run", created_at=now_ms())
    status, text = await post_event(a, forged)
    assert status == 400, text
    assert "only a node speaks for its own jobs" in text
    assert b_id in text
    # The control, the same way: a's own event is taken and reaches every member.
    entered = workload_record("entered-at-a", 1, origin=a_id, run="a-ops", created_at=now_ms())
    assert await post_event(a, entered) == (202, "")
    await eventually(lambda: lists(b, "entered-at-a"), "a's own event reaches b")
    # And a row in b's name that a holds reaches b by the path the forged one would take:
    # b's own row, lost from b's store, is asked back from a. By then a forged row a had
    # taken would have come too (it was entered first, so it settled first).
    mine = workload_record("bs-own", 1, origin=b_id, run="b-ops", created_at=now_ms())
    assert await post_event(b, mine) == (202, "")
    await eventually(lambda: lists(a, "bs-own"), "b's own event reaches a")
    forget(b, "bs-own")
    assert await listed(b, "bs-own") is None  # the control: b really lost it
    await eventually(lambda: lists(b, "bs-own"), "b asks its own row back from a", within_s=30)
    for node in pair:
        assert await listed(node, "in-bs-name") is None, node.name
        assert not stored(node, "in-bs-name"), node.name


async def test_a_row_in_bs_name_that_b_never_made_is_not_taken(pair: list[Node]) -> None:
    a, b = pair
    a_id, b_id = await a.node_id(), await b.node_id()
    declined = await b.metric("nvpair_anti_entropy_unproven_own_total")
    # a's store holds a row in b's name under a run b never made, written behind a's back
    # (as a member's store would hold one it was handed or made up), and a row of a's own
    # written the same way: the control, which only anti-entropy carries to b.
    store = await JobsStore.open(a.home / "jobs.db")
    try:
        async with JobsWriter(store) as writer:
            writer.upsert(workload("made-up", 1, origin=b_id, run="never-b", created_at=now_ms()))
            writer.upsert(
                workload("control-ae", 1, origin=a_id, run="a-behind", created_at=now_ms())
            )
            await writer.flush()
    finally:
        await store.close()
    await eventually(
        lambda: lists(b, "control-ae"), "a's row reaches b by anti-entropy", within_s=30
    )
    # Two more rounds of b's own: each would ask a for the row in b's name, were it wanted.
    after = await rounds(b)
    await eventually(lambda: _rounds_past(b, after + 2), "b starts two more rounds with a")
    assert await listed(b, "made-up") is None
    assert not stored(b, "made-up")
    assert await listed(a, "made-up") is not None  # a still offers it: b declined
    assert await b.metric("nvpair_anti_entropy_unproven_own_total") > declined


async def test_a_member_whose_jobs_db_is_lost_gets_its_own_rows_back(pair: list[Node]) -> None:
    a, b = pair
    b_id = await b.node_id()
    # b's own jobs of both kinds: one its facade ran (the facade's run), one its owner entered.
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{b.ports['facade']}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        ) as response,
    ):
        assert response.status == 200, await response.text()
    [ran] = [j for j in await b.jobs() if j["originatedFrom"] == b_id and j["model"] == MODEL]
    entered = workload_record("entered-at-b", 3, origin=b_id, run="b-ops-2", created_at=now_ms())
    assert await post_event(b, entered) == (202, "")
    want = {ran["id"]: (ran["runId"], "completed"), "entered-at-b": ("b-ops-2", "completed")}
    await eventually(lambda: _holds(a, b_id, want), "a holds b's two jobs, completed")
    # b loses its store altogether: stopped, jobs.db and its WAL deleted, started again (a
    # new facade run; the old one is known only from the run book).
    await b.stop()
    for path in b.home.iterdir():
        if path.name.startswith("jobs.db"):
            path.unlink()
    assert not (b.home / "jobs.db").exists()  # the control: b really lost them
    await b.start()
    await eventually(lambda: _holds(b, b_id, want), "b gets its own rows back", within_s=30)


async def _rounds_past(node: Node, count: float) -> bool:
    return await rounds(node) >= count


async def _holds(node: Node, origin: str, want: dict[str, tuple[str, str]]) -> bool:
    jobs = {
        j["id"]: (j["runId"], j["state"])
        for j in await node.jobs()
        if j["originatedFrom"] == origin
    }
    return all(jobs.get(wid) == held for wid, held in want.items())
