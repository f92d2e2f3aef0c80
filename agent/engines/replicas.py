"""This node's replicas: carrying out `scheduler.reconcile` with the engine supervisor.

Each round (every `ROUND_S`, and at once when a deployment or the view changes) builds the
view -- the declared deployments, every reachable member's GPUs and replicas from its
record, this node's own from what it runs -- and carries out this node's part: starts the
replicas placed on its GPUs, stops the ones the rules cut. The node that owns a GPU is the
only one that commits it (`admissible` against what it runs), so no GPU is ever under two
replicas; an allocation is written to `allocations.json` (0600) before its engine starts,
so after a `kill -9` the agent knows which engine runs for which deployment and re-adopts it
(`EngineSupervisor.adopt`), and stops any engine it has no allocation for.

A surplus replica (a race, or a member back from a partition) is stopped only when the cut
holds for `SETTLE_S`: members whose views differ for a moment must not both stop theirs.
A replica of a changed or undeployed deployment is stopped at once.

A deployment that loads an artifact (issue 28) has its weights brought first: the replica's
allocation is made (its GPUs held, so no other member places the same slot), the replica is
`fetching` while this member fetches the artifact from the members that hold it, and its
engine starts on the assembled copy once it is resident (`agent.engines.weights`). A fetch
that fails is tried again; an agent killed meanwhile finds the allocation and goes on.

A part of a replica across members (issue 32) is an allocation with its group and layout;
its engine starts when `agent.engines.parts` says, reaching the others through this member's
tunnels (`agent.engines.tunnel`). A part never restarts alone: the whole replica does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec
from msgspec import UNSET

from agent.core.errors import MemberUnreachable
from agent.engines.auth import EngineAuth
from agent.engines.load import LoadScraper
from agent.engines.observed import ObservedEngines
from agent.engines.parts import Waiting, admit_worker, part_values, through_tunnels
from agent.engines.placement_view import gpu_of, holds_of, layout_of, parts_of, running_of, want_of
from agent.engines.proc_state import EngineProcError, ReplicaState, ReplicaStatus
from agent.engines.replica_keys import engine_key, managed_keys
from agent.engines.supervisor import EngineSupervisor
from agent.engines.templates import LaunchSpec
from agent.engines.tunnel import Dial, Tunnels
from agent.engines.version import EngineVersions
from agent.engines.weights import NoWeights, Weights, WeightsState
from certs import write_atomic
from facts.deployments import Deployment, spec_digest
from facts.inventory import GpuInventory
from facts.records import NodeRecord, Part, Replica
from plane.core.ids import new_id
from scheduler.reconcile import Host, Plan, Running, Start, admissible, reconcile, seal, why_not_on

__all__ = ["ALLOCATIONS_FILE", "Allocation", "ReplicaControl"]

log = logging.getLogger(__name__)

ALLOCATIONS_FILE: Final = "allocations.json"
ROUND_S: Final = 1.0
SETTLE_S: Final = 3.0
RETRY_FAILED_S: Final = 300.0  # a failed replica is stopped (its GPUs freed) and placed anew


class Allocation(msgspec.Struct, kw_only=True, frozen=True):
    """GPUs this node committed to one replica of a deployment."""

    replica: str  # rep_ id
    id: str  # alc_ id
    deployment: str
    deploymentId: str
    spec: str
    devices: list[str]  # device ids
    createdAt: int  # epoch ms
    apiKey: str = ""  # its engine's key (replica_keys.py); this file is 0600
    artifact: str = ""  # the digest of the weights its engine loads; "" none
    launched: bool = False  # with an artifact: its engine was started (else: fetching)
    # A part of a replica across members (issue 32): its group, every part, its rank.
    group: str = ""
    layout: list[Part] = []
    rank: int = 0


_allocations: Final = msgspec.json.Decoder(list[Allocation])
_STATE: Final = {
    ReplicaState.STARTING: "starting",
    ReplicaState.READY: "ready",
    ReplicaState.FAILED: "failed",
    ReplicaState.STOPPING: "stopping",
}


class ReplicaControl:
    """`run()` converges this node's replicas until cancelled; `replicas()` for the record."""

    def __init__(
        self,
        home: Path,
        *,
        self_id: str,
        supervisor: EngineSupervisor,
        deployments: Callable[[], list[Deployment]],
        records: Callable[[], list[NodeRecord]],
        reachable: Callable[[str], bool],
        gpus: Callable[[], GpuInventory],
        cordoned: Callable[[], bool],
        name: str = "",
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        auth: EngineAuth | None = None,
        weights: Weights | None = None,
        dial: Dial | None = None,
        trusted_network: bool = False,
    ) -> None:
        self.trusted_network = trusted_network  # engines' own traffic may cross the network
        self.path = home / ALLOCATIONS_FILE
        self.observed = ObservedEngines(self_id=self_id, self_name=name, auth=auth)
        # The engines' own load, read from every replica that runs here (`run()` it).
        self.scraper = LoadScraper(self.urls, auth=auth, label_of=self._deployment_of)
        self.self_id = self_id
        self.supervisor = supervisor
        self._deployments = deployments
        self._records = records
        self._reachable = reachable
        self._gpus = gpus
        self._cordoned = cordoned
        self._on_change = on_change
        self._clock = clock
        self._wake = asyncio.Event()
        self._cuts: dict[str, float] = {}  # surplus replica -> when the cut was first planned
        self._failed_at: dict[str, float] = {}  # failed replica -> when we saw it fail
        self._versions = EngineVersions(self.observed.auth)
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._weights: Weights = weights if weights is not None else NoWeights()
        self._fetching: dict[str, WeightsState] = {}  # replica -> its weights, not yet here
        self._resident: dict[str, str] = {}  # a part waiting for its partners -> its weights
        self.allocations: dict[str, Allocation] = {a.replica: a for a in self._load()}
        self.last_plan = Plan()
        # The engines' channels of spanning replicas (a member without a dial reaches none).
        leader = lambda rid: getattr(self.supervisor.status(rid), "pid", None)  # noqa: E731
        self.tunnels = Tunnels(dial or _no_dial, self.admit, leader)  # its engine's group
        self._waiting_why: dict[str, str] = {}  # a part whose engine waits -> for what
        self._sealed: set[str] = set()  # spanning replicas seen whole (scheduler.reconcile)

    def _load(self) -> list[Allocation]:
        try:
            return _allocations.decode(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Without it the engines that run cannot be told apart: adopt() then stops them.
            log.warning("ignoring %s: %s", self.path, exc)
            return []

    def _save(self) -> None:
        write_atomic(self.path, msgspec.json.encode(sorted(self.allocations.values(), key=_by_id)))

    # -- the loop -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Re-adopt what a previous agent left running; stop what has no allocation."""
        self.supervisor.adopt()
        running = {s.replica_id for s in self.supervisor.replicas()}
        lost = [
            rid
            for rid, a in self.allocations.items()
            if rid not in running and not _unstarted(a)  # one still fetching goes on
        ]
        for rid in lost:
            log.info("%s: its engine is gone; its GPUs are free again", rid)
            del self.allocations[rid]
        stopped = await self.supervisor.retain(self.allocations)
        self._set_keys()  # the adopted engines' keys, before any call
        for rid in stopped:
            log.warning("%s: an engine with no allocation here; stopped", rid)
        if lost:
            self._save()
        engines = {d.name: d.engine for d in self._deployments()}
        for rid, a in list(self.allocations.items()):  # a head's tunnels ended with the agent
            template = self.supervisor.template(engines.get(a.deployment, ""))
            if a.group and a.rank == 0 and a.launched and through_tunnels(template):
                self._stop(rid, "its tunnels ended with the agent before; restarting it whole")

    def poke(self) -> None:
        """Something changed (a deployment, a record): a round soon."""
        self._wake.set()

    def engines_changed(self) -> None:
        """An engine started, became ready or moved: its key at its (new) URL, a round soon."""
        self._set_keys()
        self.poke()

    def _set_keys(self) -> None:
        keys = managed_keys(self.allocations.values(), self.supervisor.replicas())
        self.observed.auth.set_managed(keys)  # the gone ones' forgotten

    async def run(self) -> None:
        """Rounds until cancelled."""
        while True:
            try:
                await self.round()
            except (EngineProcError, OSError) as exc:
                log.warning("replica round failed: %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ROUND_S)

    async def round(self) -> Plan:
        """One round: plan over the view, carry out this node's part."""
        declared = self._deployments()
        if await self.observed.probe(declared, int(time.time() * 1000)):
            self._on_change()
        workers = self._workers()
        served = [s for s in self.supervisor.replicas() if s.replica_id not in workers]
        if await self._versions.refresh(served):
            self._on_change()
        self._set_keys()
        wants = {d.name: d for d in declared if d.authority == "managed"}
        hosts = self._hosts()
        self._sealed = seal(self._sealed, hosts)  # spanning replicas seen whole
        plan = reconcile(
            self.self_id,
            [want_of(d) for d in wants.values()],
            hosts,
            now_ms=int(time.time() * 1000),
            sealed=self._sealed,
        )
        self.last_plan = plan
        now = self._clock()
        cut_now = set()
        for rid, why in plan.stop:
            if rid in self._stopping:
                continue
            if why.startswith("more than"):
                first = self._cuts.setdefault(rid, now)
                if now - first < SETTLE_S:
                    cut_now.add(rid)
                    continue
            self._stop(rid, why)
        self._cuts = {rid: t for rid, t in self._cuts.items() if rid in cut_now}
        self._retry_failed(now)
        for start in plan.start:
            mine = self._running()
            if not admissible(start, mine):
                continue  # a plan from a view older than what runs here
            self._launch(wants[start.deployment], start)
        await self._bring_weights(wants)
        await self._bring_parts(wants)
        return plan

    async def _bring_weights(self, wants: dict[str, Deployment]) -> None:
        """Each replica still without its weights: their fetch goes on, and its engine
        starts once they are resident."""
        for a in list(self.allocations.values()):
            if not self._fetching_of(a) or a.replica in self._stopping:
                continue
            deployment = _current(a, wants)
            if deployment is None:
                continue  # the plan stops it
            state = await self._weights.need(a.artifact)
            if state.path is None:
                if self._fetching.get(a.replica) != state:
                    self._fetching[a.replica] = state
                    self._on_change()  # its progress, in the record
                continue
            if self._fetching.pop(a.replica, None) is not None or a.replica not in self._resident:
                log.info("replica %s of %s: its weights are here", a.replica, a.deployment)
            self._resident[a.replica] = str(state.path)
            if not a.group:
                self._start_engine(a, deployment, str(state.path))

    async def _bring_parts(self, wants: dict[str, Deployment]) -> None:
        """Each part whose engine waits for its partners: started once they are there."""
        for a in list(self.allocations.values()):
            if a.launched or not a.group or a.replica in self._stopping or self._fetching_of(a):
                continue
            deployment = _current(a, wants)
            if deployment is None:
                continue  # the plan stops it
            values = await part_values(
                a.replica, a.group, [(p.node, p.devices) for p in a.layout], a.rank,
                self.supervisor.template(deployment.engine), self._records(), self.tunnels,
                trusted=self.trusted_network,
            )  # fmt: skip
            if isinstance(values, Waiting):
                if self._waiting_why.get(a.replica) != values.why:
                    self._waiting_why[a.replica] = values.why
                    self._on_change()  # why, in the record
                continue
            self._waiting_why.pop(a.replica, None)
            model = self._resident.get(a.replica, deployment.source or deployment.name)
            self._start_engine(a, deployment, model, values)

    def _fetching_of(self, a: Allocation) -> bool:
        """Whether the allocation waits for its weights (no engine started for it yet)."""
        return bool(a.artifact) and not a.launched and a.replica not in self._resident

    def _shown(self, status: ReplicaStatus | None, allocation: Allocation) -> str:
        # An allocation whose engine the supervisor does not hold (yet): fetching its
        # weights, or starting (a part waiting for its partners too).
        if allocation.replica in self._stopping:
            return "stopping"
        if status is None:
            return "fetching" if self._fetching_of(allocation) else "starting"
        return _STATE[status.state]

    def weights_in_use(self) -> set[str]:
        """The artifacts the replicas here load or are fetching: never evicted."""
        return {a.artifact for a in self.allocations.values() if a.artifact}

    def _retry_failed(self, now: float) -> None:
        # A failed replica holds its GPUs and counts as one of the declared (so a broken
        # deployment cannot spread); after RETRY_FAILED_S it is stopped and placed anew.
        failed = {
            s.replica_id for s in self.supervisor.replicas() if s.state is ReplicaState.FAILED
        }
        for rid in failed - self._failed_at.keys():
            self._failed_at[rid] = now
        self._failed_at = {rid: t for rid, t in self._failed_at.items() if rid in failed}
        for rid, since in list(self._failed_at.items()):
            if now - since >= RETRY_FAILED_S and rid not in self._stopping:
                self._stop(rid, f"failed {RETRY_FAILED_S:.0f} s ago; placing it anew")

    # -- carrying out -------------------------------------------------------------------------

    def _launch(self, deployment: Deployment, start: Start) -> None:
        devices = start.devices
        key = engine_key(deployment, self.path.parent)
        if key is None:
            return  # its key file cannot be used (said once in the log)
        allocation = Allocation(
            replica=new_id("rep"),
            id=new_id("alc"),
            deployment=deployment.name,
            deploymentId=deployment.id,
            spec=spec_digest(deployment),
            devices=list(devices),
            createdAt=int(time.time() * 1000),
            apiKey=key,
            artifact=deployment.weights if start.rank == 0 else "",  # a worker loads none
            group=start.group or (new_id("grp") if start.layout else ""),  # a head names it
            layout=parts_of(start.layout),
            rank=start.rank,
        )
        self.allocations[allocation.replica] = allocation
        self._save()  # written down before the engine starts: never an engine we cannot name
        if allocation.group:
            log.info(
                "part %d of %d of replica %s of %s on %d GPU(s)",
                start.rank, len(start.layout), allocation.group, deployment.name, len(devices),
            )  # fmt: skip
            self._on_change()
            return  # the rounds bring its weights and its partners, then start its engine
        if allocation.artifact:
            log.info(
                "replica %s of %s on %d GPU(s): fetching its weights first",
                allocation.replica,
                deployment.name,
                len(devices),
            )
            self._on_change()
            return  # the rounds bring its weights, then start its engine
        self._start_engine(allocation, deployment, deployment.source or deployment.name)

    def _start_engine(
        self,
        allocation: Allocation,
        deployment: Deployment,
        model: str,
        part: dict[str, str | int] | None = None,
    ) -> None:
        uuids = {d.id: d.uuid for d in self._gpus().devices}
        devices = allocation.devices
        key = allocation.apiKey
        spec = LaunchSpec(
            replica_id=allocation.replica,
            kind=deployment.engine,
            model=model,
            served=deployment.name,
            tp=deployment.tp,
            gpu_uuids=tuple(uuids[d] for d in devices if d in uuids),
            extra_args=tuple(deployment.args) if allocation.rank == 0 else (),
            api_key=key if allocation.rank == 0 else "",
            **(part or {}),  # type: ignore[arg-type]  # rank, nodes, workers, ...: part_values
        )
        if allocation.artifact or allocation.group:
            allocation = msgspec.structs.replace(allocation, launched=True)
            self.allocations[allocation.replica] = allocation
            self._save()
        try:
            started = self.supervisor.launch(spec)
            if key:
                self.observed.auth.add_managed(started.url, key)  # before it can be called
        except EngineProcError as exc:
            del self.allocations[allocation.replica]
            self._save()
            log.warning("cannot start a replica of %s: %s", deployment.name, exc)
            return
        log.info(
            "starting replica %s of %s on %d GPU(s)",
            allocation.replica,
            deployment.name,
            len(devices),
        )
        self._on_change()

    def _stop(self, rid: str, why: str) -> None:
        log.info("stopping replica %s: %s", rid, why)

        async def stop() -> None:
            try:
                await self.tunnels.close(rid)
                await self.supervisor.stop(rid)
            finally:
                self._resident.pop(rid, None)
                self._waiting_why.pop(rid, None)
                self.allocations.pop(rid, None)
                self._fetching.pop(rid, None)
                self._save()
                self._stopping.pop(rid, None)
                self._on_change()
                self.poke()

        self._stopping[rid] = asyncio.create_task(stop(), name=f"stop {rid}")
        self._on_change()

    async def aclose(self) -> None:
        """Let stops in progress finish; the engines themselves keep running."""
        await self.observed.aclose()
        await self.tunnels.aclose()
        if self._stopping:
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)

    # -- the view -----------------------------------------------------------------------------

    def _running(self) -> list[Running]:
        status = {s.replica_id: s for s in self.supervisor.replicas()}
        return [
            Running(
                a.replica,
                a.deployment,
                a.deploymentId,
                a.spec,
                tuple(a.devices),
                self._shown(status.get(a.replica), a),
                a.createdAt,
                group=a.group,
                layout=layout_of(a.layout),
            )
            for a in self.allocations.values()
        ]

    def _hosts(self) -> list[Host]:
        inventory = self._gpus()
        records = self._records()
        own = next((r for r in records if r.nodeId == self.self_id), None)
        me = Host(
            self.self_id,
            self.observed.self_name,
            cordoned=self._cordoned(),
            gpus=tuple(
                gpu_of(d.id, d.deviceClass, d.memoryTotal, d.health, d.domainId)
                for d in inventory.devices
            ),
            replicas=tuple(self._running()),
            holds=holds_of(own) if own is not None else frozenset(),
        )
        hosts = [me]
        for record in records:
            if record.nodeId == self.self_id:
                continue
            hosts.append(
                Host(
                    record.nodeId,
                    record.name,
                    reachable=self._reachable(record.nodeId),
                    cordoned=record.cordoned,
                    gpus=tuple(
                        gpu_of(d.id, d.deviceClass, d.memoryTotal, d.health, d.domainId)
                        for d in record.devices
                    ),
                    replicas=tuple(running_of(r) for r in record.replicas),
                    holds=holds_of(record),
                )
            )
        return hosts

    def replicas(self) -> list[Replica]:
        """This node's replicas as its record says them."""
        status = {s.replica_id: s for s in self.supervisor.replicas()}
        loads = self.scraper.current()
        out = []
        for a in sorted(self.allocations.values(), key=_by_id):
            s = status.get(a.replica)
            state = self._shown(s, a)
            load = loads.get(a.replica)
            error = s.reason if s is not None else ""
            if state == "fetching":
                fetching = self._fetching.get(a.replica)
                error = fetching.progress() if fetching else "fetching its weights"
            elif a.replica in self._waiting_why:
                error = self._waiting_why[a.replica]
            out.append(
                Replica(
                    id=a.replica,
                    deployment=a.deployment,
                    deploymentId=a.deploymentId,
                    spec=a.spec,
                    allocation=a.id,
                    devices=a.devices,
                    port=s.port if s is not None else 0,
                    state=state,  # type: ignore[arg-type]  # one of the five
                    restarts=s.restarts if s is not None else 0,
                    engineVersion=self._versions.get(a.replica),
                    error=error[:256],
                    createdAt=a.createdAt,
                    running=load.running if load else 0.0,
                    waiting=load.waiting if load else 0.0,
                    kvUsage=load.kv_usage if load else None,
                    loadAt=load.at_ms if load else 0,
                    group=a.group or UNSET,
                    layout=a.layout if a.group else UNSET,
                )
            )
        for watched in self.observed.replicas():
            load = loads.get(watched.id)
            out.append(
                msgspec.structs.replace(
                    watched,
                    running=load.running if load else 0.0,
                    waiting=load.waiting if load else 0.0,
                    kvUsage=load.kv_usage if load else None,
                    loadAt=load.at_ms if load else 0,
                )
            )
        return out

    def why_not(self, name: str) -> list[tuple[Host, str | None]] | None:
        """`nvpair explain --deployment`: every member of this round's view and why a replica
        of `name` cannot go there now (None: it can); None when `name` is not managed here."""
        found = [d for d in self._deployments() if d.name == name and d.authority == "managed"]
        return [(h, why_not_on(want_of(found[0]), h)) for h in self._hosts()] if found else None

    def _workers(self) -> set[str]:
        """The worker parts of spanning replicas here: their heads serve."""
        return {rid for rid, a in self.allocations.items() if a.group and a.rank > 0}

    def admit(self, caller: str, replica_id: str) -> int | str:
        """The port of `replica_id`'s engine here when `caller` may reach it through a tunnel
        (the member of its replica's head, for a worker part), else why not."""
        a = self.allocations.get(replica_id)
        status = self.supervisor.status(replica_id)
        port = status.port if status is not None and replica_id not in self._stopping else 0
        head = a.layout[0].node if a is not None and a.group and a.rank > 0 else ""
        return admit_worker(replica_id, head, caller, port)

    def url_of(self, replica_id: str) -> str | None:
        """Where a ready replica of this node listens, or None."""
        status = self.supervisor.status(replica_id)
        if status is None or status.state is not ReplicaState.READY:
            return self.observed.url_of(replica_id)
        return status.url

    def _deployment_of(self, replica_id: str) -> str:
        allocation = self.allocations.get(replica_id)
        return allocation.deployment if allocation is not None else "other"

    def urls(self) -> dict[str, str]:
        """Replica id -> url of every replica that runs here, for the load scraper."""
        workers = self._workers()  # their engines speak no HTTP (llama.cpp's RPC server)
        running = self.supervisor.replicas()
        urls = {s.replica_id: s.url for s in running if s.port and s.replica_id not in workers}
        return {**urls, **self.observed.urls()}


def _by_id(a: Allocation) -> str:
    return a.replica


def _current(a: Allocation, wants: dict[str, Deployment]) -> Deployment | None:
    """The deployment the allocation was made for, while it is still the declared one."""
    found = wants.get(a.deployment)
    if found is None or (found.id, spec_digest(found)) != (a.deploymentId, a.spec):
        return None
    return found


def _unstarted(a: Allocation) -> bool:
    """Whether the allocation's engine waits to be started (for its weights, or a part's for
    its partners): none is started for it yet."""
    return (bool(a.artifact) or bool(a.group)) and not a.launched


def _no_dial(member: str, replica: str) -> Any:
    raise MemberUnreachable(f"this member reaches no tunnel ({replica} on {member})")
