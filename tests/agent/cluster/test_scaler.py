"""The scaler's part of elastic deployments (issue 30), in memory: what load a deployment is
seen to have (every member's replicas and wait lines, its own line read directly), the GPUs
free, and who decides -- the deployment's first member in rendezvous order,
only while it reaches more than half of the members, and nobody while the feature is off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from agent.cluster import scaler as scaler_module
from agent.cluster.deployments import DeploymentRequest, Deployments
from agent.cluster.scaler import MAX_SAMPLES, Scaler, deployment_load, free_gpus
from facts.deployments import Deployment
from facts.inventory import Device
from facts.key_limits import holder_of
from facts.records import NodeRecord, Replica
from tests.fixtures.records import node_record
from tests.fixtures.waiting import eventually

IDS = ["nod_a", "nod_b", "nod_c"]


def _unsigned(d: Deployment) -> Deployment:
    return msgspec.structs.replace(d, by="nod_x", signature="")


def _store(tmp_path: Path, gpus: int = 1, **bounds: object) -> tuple[Deployments, Deployment]:
    store = Deployments(tmp_path, sign=_unsigned)
    asked: dict[str, object] = {"minReplicas": 0, "maxReplicas": 3, **bounds}
    ask = DeploymentRequest(name="chat", engine="mock", gpus=gpus, **asked)  # type: ignore[arg-type]
    made = store.declare(ask)
    return store, made


def _replica(d: Deployment, n: int, state: str = "ready", **load: float) -> Replica:
    return Replica(
        id=f"rep_{n:026d}",
        deployment=d.name,
        deploymentId=d.id,
        spec="s",
        state=state,  # type: ignore[arg-type]
        devices=[f"gpu{n}"],
        **load,  # type: ignore[arg-type]
    )


def _device(n: int, health: str = "ok") -> Device:
    return Device(
        id=f"gpu{n}", uuid=f"u{n}", index=n, name="L4", deviceClass="l4", memoryTotal=1,
        memoryUsed=0, memoryFree=1, utilization=0, temperatureC=None, powerW=None,
        eccUncorrected=None, health=health,
    )  # fmt: skip


def test_the_load_counts_every_members_replicas_and_wait_lines(tmp_path: Path) -> None:
    _, d = _store(tmp_path)
    records = [
        node_record("nod_a", replicas=[_replica(d, 1, running=2, waiting=1)], waitLine={"chat": 9}),
        node_record("nod_b", replicas=[_replica(d, 2, "starting")], waitLine={"chat": 4, "x": 7}),
        node_record("nod_c"),
    ]
    seen = deployment_load(d, records, self_id="nod_a", waiting_here={"chat": 2}, now_s=5.0)
    # a's own line is read directly (its record's 9 is older), b's from its record.
    assert (seen.at_s, seen.ready, seen.running, seen.waiting) == (5.0, 1, 2, 1 + 4 + 2)


def test_free_gpus_are_those_no_replica_holds_on_members_that_take_work(tmp_path: Path) -> None:
    _, d = _store(tmp_path)
    records = [
        node_record("nod_a", devices=[_device(1), _device(2)], replicas=[_replica(d, 1)]),
        node_record("nod_b", devices=[_device(3)], cordoned=True),  # takes nothing new
        node_record("nod_c", devices=[_device(4), _device(5), _device(6), _device(7, "failed")]),
    ]
    assert free_gpus(records) == 1 + 3  # a failed GPU holds nothing, a cordoned member none


class Cluster:
    """Three members' scalers over one set of records; `reach` and `gate` are the views."""

    def __init__(self, tmp_path: Path) -> None:
        self.records: list[NodeRecord] = [node_record(n) for n in IDS]
        self.waiting: dict[str, int] = {}
        self.reach: dict[str, list[str]] = dict.fromkeys(IDS, IDS)
        self.gate = True
        self.now = 1000.0
        self.stores: dict[str, Deployments] = {}
        self.scalers: dict[str, Scaler] = {}
        for node in IDS:
            (tmp_path / node).mkdir()
            store, _ = _store(tmp_path / node, gpus=0, scaleDownAfterS=60, idleToZeroS=60)
            self.stores[node] = store
            self.scalers[node] = Scaler(
                self_id=node,
                deployments=store,
                records=lambda: self.records,
                waiting_here=lambda: self.waiting,
                holders=lambda node=node: self.reach[node],  # type: ignore[misc]
                members=lambda: 3,
                enabled=lambda: self.gate,
                clock=lambda: self.now,
            )

    def step(self) -> dict[str, int]:
        """One round everywhere: the count each member's copy has after it."""
        for scaler in self.scalers.values():
            scaler.step()
        return {n: s.get("chat").replicas for n, s in self.stores.items()}  # type: ignore[union-attr]


def _count(cluster: Cluster, node: str) -> int:
    held = cluster.stores[node].get("chat")
    assert held is not None
    return held.replicas


def _ready(cluster: Cluster, node: str) -> Replica:
    held = cluster.stores[node].get("chat")
    assert held is not None
    return _replica(held, 1)


def test_one_member_decides_and_the_others_only_sample(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.waiting = {"chat": 5}  # requests wait at zero
    decider = holder_of("chat", IDS)
    counts = cluster.step()
    assert counts == {n: (1 if n == decider else 0) for n in IDS}  # one scale-up, one member
    assert all(len(s.tracks["chat"].samples) == 1 for s in cluster.scalers.values())
    assert cluster.scalers[decider].changes == {("chat", "waiting"): 1}
    assert cluster.scalers[decider].cold_starts.count == 0  # not ready yet
    cluster.now += 1
    assert cluster.step()[decider] == 1  # still starting: nothing more is asked for
    cluster.waiting = {}  # it came up and took what waited
    cluster.records = [node_record("nod_a", replicas=[_ready(cluster, decider)])]
    cluster.now += 3
    assert cluster.step()[decider] == 1
    cold = cluster.scalers[decider].cold_starts
    assert (cold.count, cold.total_s) == (1, 4.0)  # from the scale-up to a replica ready


def test_nobody_decides_on_the_small_side_or_with_the_gate_closed(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.waiting = {"chat": 5}
    decider = holder_of("chat", IDS)
    cluster.reach[decider] = [decider]  # it reaches nobody: one of three
    cluster.gate = False
    assert cluster.step() == dict.fromkeys(IDS, 0)
    cluster.gate = True
    counts = cluster.step()
    assert counts[decider] == 0  # on the small side: no change
    # The others pick the next decider among the two they reach: the control.
    others = [n for n in IDS if n != decider]
    for node in others:
        cluster.reach[node] = others
    assert cluster.step()[holder_of("chat", others)] == 1


def test_samples_stay_bounded_whatever_the_windows(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    scaler = cluster.scalers["nod_a"]
    for _ in range(3 * MAX_SAMPLES):
        cluster.now += 1
        scaler.step()
    assert len(scaler.tracks["chat"].samples) <= MAX_SAMPLES + 1
    cluster.stores["nod_a"].undeploy("chat")
    scaler.step()
    assert scaler.tracks == {}  # an undeployed deployment's samples go


def test_a_cold_deployment_gets_a_gpu_from_one_above_its_min_by_the_rule(tmp_path: Path) -> None:
    store = Deployments(tmp_path, sign=_unsigned)
    busy = store.declare(
        DeploymentRequest(name="busy", engine="mock", minReplicas=1, maxReplicas=2, replicas=2)
    )
    store.declare(DeploymentRequest(name="cold", engine="mock", minReplicas=0, maxReplicas=1))
    replicas = [_replica(busy, 1), _replica(busy, 2)]
    records = [node_record("nod_a", devices=[_device(1), _device(2)], replicas=replicas)]
    waiting = {"cold": 3}
    scaler = Scaler(
        self_id="nod_a",
        deployments=store,
        records=lambda: records,
        waiting_here=lambda: waiting,
        holders=lambda: ["nod_a"],
        members=lambda: 1,
        enabled=lambda: True,
        clock=lambda: 2_000_000.0,
    )
    made = dict(scaler.step())
    assert (made["busy"].desired, made["busy"].reason) == (1, "yielded")
    assert (made["cold"].desired, made["cold"].reason) == (1, "waiting")
    # The control: nothing waits for cold, so busy keeps both replicas.
    store.scale("busy", 2)
    store.scale("cold", 0)
    waiting = {}
    made = dict(scaler.step())
    assert (made["busy"].desired, made["cold"].desired) == (2, 0)


async def test_a_wait_line_for_a_deployment_at_zero_wakes_the_decider_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scaler_module, "SAMPLE_S", 3600.0)  # no period: only a wake steps
    cluster = Cluster(tmp_path)
    decider = cluster.scalers[holder_of("chat", IDS)]
    assert not decider.cold_line("chat")  # never sampled: not known to be at zero
    cluster.step()  # sampled at zero, nothing waiting: stays at zero
    assert decider.cold_line("chat")
    assert not decider._woken.is_set()
    decider.pushed(node_record("nod_b", waitLine={"other": 3}))  # not one at zero: nothing
    decider.pushed(None)  # a push from a member whose record is not held: nothing
    assert not decider._woken.is_set()
    cluster.records = [node_record("nod_b", waitLine={"chat": 1})]
    decider.pushed(cluster.records[0])  # the control: a member's line for it wakes the round
    assert decider._woken.is_set()
    cluster.waiting = {"chat": 1}
    task = asyncio.create_task(decider.run())
    try:  # the woken round scales it up: the period (an hour here) never passes
        await eventually(lambda: _count(cluster, decider.self_id) == 1, "scaled up at once")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    cluster.records = [node_record("nod_a", replicas=[_ready(cluster, decider.self_id)])]
    cluster.step()  # ready now: a line for it is no cold start
    assert not decider.cold_line("chat")
