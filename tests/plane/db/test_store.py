"""The plane store on a real PostgreSQL: enrolment, sync (newer wins, replays change
nothing, one writer), fleet summary, keyset pagination."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from psycopg_pool import AsyncConnectionPool

from agent.engines.gpus import simulate
from plane.core.errors import SyncRefused
from plane.core.ids import new_id
from plane.core.wire import NodeSummary, SyncBatch
from plane.db.migrate import migrate
from plane.db.store import PlaneStore
from workload_manager.workload import decode_workload


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PlaneStore]:
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        async with pool.connection() as conn:
            await migrate(conn)
        yield PlaneStore(pool)


def job(origin: str, wid: str, seq: int, **extra: Any) -> Any:
    state = {1: "queued", 2: "running", 3: "completed"}[seq]
    record = {
        "id": wid,
        "model": "llama",
        "engine": "vllm",
        "runId": "r",
        "state": state,
        "originatedFrom": origin,
        "createdAt": 1_000_000 + int(wid),
        "seq": seq,
        **extra,
    }
    if seq >= 2:
        record.setdefault("startedAt", 1_000_500 + int(wid))
        record.setdefault("scheduledOn", origin)
    if seq == 3:
        record.setdefault("completedAt", 1_002_000 + int(wid))
    return decode_workload(json.dumps(record))


def batch(node: str, generation: int, jobs: list[Any], gpus: str = "h100-80gb-sxm:8") -> SyncBatch:
    inventory = simulate(gpus, node)
    return SyncBatch(
        nodeId=node,
        generation=generation,
        node=NodeSummary(name=node[-4:], version="0.1.0"),
        devices=inventory.devices,
        domains=inventory.domains,
        jobs=jobs,
    )


async def test_enrol_authenticate_revoke(store: PlaneStore) -> None:
    cluster, token = await store.enrol("lab")
    assert await store.cluster_for(token) == cluster
    other = "y" if token.endswith("x") else "x"  # never the token's own last character
    assert await store.cluster_for(token[:-1] + other) is None
    assert await store.cluster_for("hgro1.nonsense") is None
    assert await store.revoke(cluster)
    assert await store.cluster_for(token) is None


async def test_sync_newer_wins_and_replay_changes_nothing(store: PlaneStore) -> None:
    cluster, _ = await store.enrol("lab")
    node = new_id("nod")
    first = batch(node, 5, [job(node, "1", 1), job(node, "2", 3)])
    await store.sync(cluster, first)
    await store.sync(cluster, batch(node, 6, [job(node, "1", 3)]))
    before = await store.fleet_summary()
    page, _ = await store.jobs(cluster_id=cluster, state=None, model=None, after=None, limit=10)
    await store.sync(cluster, first)  # replayed late: older generation and seqs
    assert await store.fleet_summary() == before
    again, _ = await store.jobs(cluster_id=cluster, state=None, model=None, after=None, limit=10)
    assert again == page
    assert {(j["id"], j["state"]) for j in again} == {("1", "completed"), ("2", "completed")}


async def test_one_writer_per_object(store: PlaneStore) -> None:
    a, _ = await store.enrol("a")
    b, _ = await store.enrol("b")
    node = new_id("nod")
    await store.sync(a, batch(node, 1, []))
    with pytest.raises(SyncRefused, match="belongs to another cluster"):
        await store.sync(b, batch(node, 2, []))
    other = new_id("nod")
    with pytest.raises(SyncRefused, match="originated on"):
        await store.sync(a, batch(node, 3, [job(other, "1", 1)]))


async def test_fleet_summary_counts(store: PlaneStore) -> None:
    a, _ = await store.enrol("a")
    b, _ = await store.enrol("b")
    na, nb = new_id("nod"), new_id("nod")
    await store.sync(a, batch(na, 1, [job(na, str(i), 3) for i in range(5)] + [job(na, "9", 2)]))
    await store.sync(b, batch(nb, 1, [job(nb, "1", 1)], gpus="l4:2"))
    fleet = await store.fleet_summary(window_s=10**11)
    summary = {c["name"]: c for c in fleet["clusters"]}
    assert summary["a"]["nodes"] == {"reachable": 1, "unreachable": 0, "cordoned": 0}
    assert summary["a"]["gpus"] == {"h100-80gb-sxm": {"ok": 8}}
    assert summary["b"]["gpus"] == {"l4": {"ok": 2}}
    assert summary["a"]["jobs"]["byState"] == {"completed": 5, "running": 1}
    assert summary["a"]["memory"]["total"] == 8 * 80 * 1024**3
    # Percentiles come from ~10 %-wide log buckets: within 10 % of the true value.
    assert fleet["jobs"]["byState"] == {"completed": 5, "running": 1, "queued": 1}
    assert fleet["jobs"]["byModel"] == {"llama": 7}
    assert fleet["jobs"]["queueMs"]["p50"] == pytest.approx(500, rel=0.1)
    assert fleet["jobs"]["runMs"]["p50"] == pytest.approx(1500, rel=0.1)
    one = await store.fleet_summary(window_s=10**11, cluster_id=b)
    assert [c["name"] for c in one["clusters"]] == ["b"]
    assert one["jobs"]["byState"] == {"queued": 1}


async def test_keyset_pagination_covers_everything_once(store: PlaneStore) -> None:
    cluster, _ = await store.enrol("lab")
    node = new_id("nod")
    await store.sync(cluster, batch(node, 1, [job(node, str(i), 1) for i in range(25)]))
    seen: list[str] = []
    after = None
    while True:
        page, after = await store.jobs(
            cluster_id=cluster, state="queued", model=None, after=after, limit=10
        )
        seen += [j["id"] for j in page]
        if after is None:
            break
    assert sorted(seen, key=int) == [str(i) for i in range(25)]


def test_sync_batch_rejects_a_prompt_field_silently() -> None:
    node = new_id("nod")
    raw = msgspec.json.encode(batch(node, 1, [job(node, "1", 1)]))
    decoded = json.loads(raw)
    decoded["jobs"][0]["prompt"] = "PROMPT-MARKER"
    again = msgspec.json.decode(json.dumps(decoded), type=SyncBatch)
    assert b"PROMPT-MARKER" not in msgspec.json.encode(again)
