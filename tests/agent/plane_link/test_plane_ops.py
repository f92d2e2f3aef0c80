"""The agent's machinery side of the plane, in memory: plane operations carried out by the
real `Operations` of the node they target, once (across a restart too), their phases in
the next sync batch until the plane has the final one; and the events, components and
cache residency each batch carries."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import msgspec

from agent.artifacts.fetcher import Sources
from agent.artifacts.fetches import Fetches
from agent.artifacts.store import ArtifactStore, describe_files
from agent.artifacts.weights import StoreWeights
from agent.cluster.artifacts import Artifacts
from agent.engines.gpus import simulate
from agent.plane_link.events import CacheReports, ComponentReports, EventReports
from agent.plane_link.ops import INTERRUPTED, PlaneOps
from certs.ids import new_node_id, prefixed_ulid
from facts.deployments import Deployment
from facts.records import NodeRecord, Replica
from plane.core.wire import SyncBatch
from plane.desired.state import DesiredOperation, DesiredState, WarmArtifact
from tests.fixtures.operations_node import OperationsNode
from tests.fixtures.records import node_record
from tests.fixtures.waiting import eventually

NODE = new_node_id()
CLUSTER = prefixed_ulid("clu")


def desired(*operations: DesiredOperation, warm: list[WarmArtifact] | None = None) -> DesiredState:
    return DesiredState(cluster=CLUSTER, generation=7, operations=list(operations), warm=warm or [])


def next_batch(*reporters: Any, record: NodeRecord | None = None) -> SyncBatch:
    """The batch the sync would build now: every reporter's fields, through the wire."""
    record = record or node_record(NODE)
    extra: dict[str, Any] = {}
    for reporter in reporters:
        extra.update(reporter.fields(record))
    built = SyncBatch(nodeId=NODE, generation=record.generation, **extra)
    return msgspec.json.decode(msgspec.json.encode(built), type=SyncBatch)  # bounds checked


async def test_a_plane_drain_runs_once_here_and_reports_until_final(tmp_path: Path) -> None:
    node = OperationsNode(NODE)
    handler = PlaneOps(node.operations, self_id=NODE, home=tmp_path)
    drain = DesiredOperation(
        id=prefixed_ulid("opr"), kind="drain", target=NODE, requester="admin", reason="kernel",
        timeoutS=60,
    )  # fmt: skip
    elsewhere = DesiredOperation(
        id=prefixed_ulid("opr"), kind="cordon", target=new_node_id(), requester="admin"
    )
    node.jobs = ["job-1"]
    await handler.on_desired(desired(drain, elsewhere))
    await handler.on_desired(desired(drain, elsewhere))  # the next fetch: same operation
    await eventually(lambda: node.phase(drain.id) == "running", "the drain running")
    [view] = node.operations.views()  # as `nvpair ops` shows it: the plane's id and requester
    assert (view["id"], view["requester"], view["reason"]) == (drain.id, "plane:admin", "kernel")
    assert node.cordons == [True]
    assert node.operations.get(elsewhere.id) is None

    [report] = next_batch(handler).operations
    assert (report.id, report.phase) == (drain.id, "running")
    handler.sent()
    assert next_batch(handler).operations == []  # the plane has it: nothing new to say

    node.jobs = []  # the job ends: the drain succeeds
    await eventually(lambda: node.phase(drain.id) == "succeeded", "the drain done")
    batch = next_batch(handler)
    assert [(r.phase, r.result) for r in batch.operations] == [
        ("succeeded", "drained: no job runs there")
    ]
    assert next_batch(handler).operations == batch.operations  # not accepted: sent again
    handler.sent()
    assert next_batch(handler).operations == []

    # A restart: a fresh Operations and handler on the same home never run it again.
    again = OperationsNode(NODE)
    restarted = PlaneOps(again.operations, self_id=NODE, home=tmp_path)
    await restarted.on_desired(desired(drain))
    assert again.operations.views() == []
    assert again.cordons == []
    assert next_batch(restarted).operations == []


async def test_an_operation_cut_short_by_a_restart_is_reported_failed(tmp_path: Path) -> None:
    node = OperationsNode(NODE)
    node.jobs = ["job-1"]
    handler = PlaneOps(node.operations, self_id=NODE, home=tmp_path)
    drain = DesiredOperation(id=prefixed_ulid("opr"), kind="drain", target=NODE, requester="ten")
    await handler.on_desired(desired(drain))
    await eventually(lambda: node.phase(drain.id) == "running", "the drain running")
    for task in node.tasks:
        task.cancel()  # the agent stops mid-drain
    await asyncio.gather(*node.tasks, return_exceptions=True)

    again = OperationsNode(NODE)
    restarted = PlaneOps(again.operations, self_id=NODE, home=tmp_path)
    await restarted.on_desired(desired(drain))
    assert again.operations.views() == []  # not started twice
    [report] = next_batch(restarted).operations
    assert (report.phase, report.result) == ("failed", INTERRUPTED)
    # A home that was this node's says nothing of its operations to another node.
    other = new_node_id()
    assert (
        next_batch(
            PlaneOps(OperationsNode(other).operations, self_id=other, home=tmp_path)
        ).operations
        == []
    )


def replica(state: str, error: str = "", version: str = "") -> Replica:
    return Replica(
        id="rep_" + "0" * 26, deployment="llama", deploymentId="dep_" + "1" * 26, spec="s",
        state=state, error=error, engineVersion=version,  # type: ignore[arg-type]
    )  # fmt: skip


def test_events_come_from_consecutive_records_and_stay_until_accepted(tmp_path: Path) -> None:
    gpus = simulate("l4:2", NODE)
    ok, other = gpus.devices

    def record(health: str, state: str, gen: int) -> NodeRecord:
        device = msgspec.structs.replace(ok, health=health, problem="ECC errors")
        return node_record(
            NODE, gen, devices=[device, other], replicas=[replica(state, "exited 1")]
        )

    events = EventReports(home=tmp_path, plane_url="http://plane", node_id=NODE)
    first = next_batch(events, record=record("ok", "starting", 1)).events
    assert [(e.kind, e.about) for e in first] == [("node-joined", NODE)]
    sent = next_batch(events, record=record("degraded", "ready", 2)).events
    assert [e.kind for e in sent] == ["node-joined", "device-degraded", "replica-ready"]
    events.sent()
    later = next_batch(events, record=record("failed", "failed", 3)).events
    assert [(e.kind, e.about) for e in later] == [
        ("device-failed", ok.id),
        ("engine-load-failed", replica("failed").id),
    ]
    assert later[1].message == "llama: exited 1"
    events.sent()
    assert next_batch(events, record=record("failed", "failed", 4)).events == []  # unchanged
    # The node joined this plane once: a restart says nothing of it again.
    restarted = EventReports(home=tmp_path, plane_url="http://plane", node_id=NODE)
    assert next_batch(restarted, record=record("ok", "starting", 5)).events == []
    elsewhere = EventReports(home=tmp_path, plane_url="http://other-plane", node_id=NODE)
    assert [e.kind for e in next_batch(elsewhere).events] == ["node-joined"]


async def test_components_and_cache_are_sent_when_they_change(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    declared = Deployment(id="dep_" + "1" * 26, name="llama", engine="vllm", source="hf:llama")
    components = ComponentReports(lambda name: declared if name == "llama" else None)
    cache = CacheReports(lambda name: declared if name == "llama" else None)
    here = WarmArtifact(artifact=prefixed_ulid("art"), digest="sha256:a", locations=[str(weights)])
    served = WarmArtifact(artifact=prefixed_ulid("art"), digest="sha256:b", locations=["hf:llama"])
    cold = WarmArtifact(artifact=prefixed_ulid("art"), digest="sha256:c", locations=["/nowhere"])
    await cache.on_desired(desired(warm=[here, served, cold]))

    starting = node_record(NODE, 1, replicas=[replica("starting")])
    batch = next_batch(components, cache, record=starting)
    assert [(c.name, c.version) for c in batch.components or []] == [
        ("agent", "test"),
        ("engine:vllm:llama", ""),
    ]
    assert [(c.artifact, c.resident) for c in batch.cache or []] == [
        (here.artifact, True), (served.artifact, False), (cold.artifact, False),
    ]  # fmt: skip
    components.sent()
    cache.sent()
    assert next_batch(components, cache, record=starting).components is None  # unchanged

    ready = node_record(NODE, 2, replicas=[replica("ready", version="0.6.1")])
    batch = next_batch(components, cache, record=ready)
    assert ("engine:vllm:llama", "0.6.1") in [(c.name, c.version) for c in batch.components or []]
    assert [c.resident for c in batch.cache or []] == [True, True, False]  # served from it


async def test_cache_residency_comes_from_the_artifact_store(tmp_path: Path) -> None:
    """Issue 28: a warm artifact the cluster knows is resident only once the store holds
    every piece verified -- not because a path among its locations exists -- and the warm
    set the plane declares is handed to the member's artifacts, which fetch it."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "w.bin").write_bytes(os.urandom(3 * 65536))
    manifest = describe_files(weights, 65536)
    artifacts = Artifacts(tmp_path, sign=lambda a: a)
    known = artifacts.add("w", manifest)
    store = ArtifactStore(tmp_path / "store")
    held = StoreWeights(artifacts, Fetches(store, list, cast(Sources, None), _spawn))
    cache = CacheReports(lambda name: None, held)
    warm = WarmArtifact(
        artifact=prefixed_ulid("art"), digest=known.digest, locations=[str(weights)]
    )
    await cache.on_desired(desired(warm=[warm]))
    assert held.plane_warm == {known.digest}
    assert [a.name for a in held.warm()] == ["w"]  # the member fetches it
    record = node_record(NODE, 1)
    batch = next_batch(cache, record=record)
    assert [(c.resident, c.state) for c in batch.cache or []] == [(False, "missing")]
    cache.sent()
    store.put_manifest(known.digest, msgspec.json.encode(manifest))
    store.import_files(weights, known.digest)
    batch = next_batch(cache, record=record)
    assert [(c.resident, c.state, c.progress) for c in batch.cache or []] == [
        (True, "resident", 1.0)
    ]


def _spawn(name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    coro.close()
    raise AssertionError("nothing is fetched here")
