"""The node daemon: `nvpair agent run`. The composition root; no protocol logic here.

It opens the Jobs store, discovers (or simulates) GPUs, starts the workload manager under
supervision, serves the node API (records, join) and the local API, and every heartbeat
pushes this node's record -- with every record, tombstone and member certificate it holds --
to every member, merging what they answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import aiohttp
import msgspec

from broker.jobs import JobsStore, JobsWriter
from broker.records import Engine, Membership, NodeRecord, RecordsPush, Removal, push_decoder
from broker.supervisor import ManagerSupervisor
from certs import CertsError, ClientContexts, ClusterDir, PinRefused, server_hostname_for
from certs.identity import describe, load_cert, verify_issued_by
from scheduler import Cluster, DeviceView, EngineView, Load, NodeView
from workload_manager import VERSION
from workload_manager.manager import Peer
from workload_manager.relay import RemoveEvent
from workload_manager.workload import Workload

from .config import AgentConfig
from .facade import Facade
from .gpus import discover, simulate
from .local_api import LocalApi
from .node_api import NodeApi
from .operations import Operation, Phase
from .plane_sync import PlaneSync, plane_settings

__all__ = ["Agent"]

log = logging.getLogger(__name__)

SEEDS_FILE = "seeds.json"  # records learnt when joining, read at the next start
ENGINE_PROBE_S = 5.0  # engines' /v1/models is read again this often
LOAD_REFRESH_S = 0.5  # pending work per node is read from the Jobs store this often
MAX_OPERATIONS = 200  # operations kept for `nvpair ops`
VIEW_TTL_S = 0.5  # the scheduler's compiled view of the cluster is reused this long
GPU_REFRESH_BEATS = 5  # GPUs are read again every fifth heartbeat (10 s by default)


class Agent:
    """One node. `start()` brings everything up; `aclose()` takes it down in order."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.cluster = ClusterDir(config.cluster_dir)
        self.started_at = time.time()
        self._stack = contextlib.AsyncExitStack()
        self._push_now = asyncio.Event()
        self.pushes_ok = 0
        self.pushes_failed = 0
        self.engines: list[Engine] = []
        self.cordoned = False
        self.operations: dict[str, Operation] = {}
        self._remote_load: dict[str, int] = {}
        self._view_cache: tuple[tuple[tuple[str, int], ...], float, Cluster] | None = None
        self._pushes: dict[str, asyncio.Task[None]] = {}  # node id -> its record push

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bring the node up; raises `CertsError` without a cluster identity."""
        config = self.config
        identity = self.cluster.load_identity()
        self.node_id = identity.node.node_id
        self.ca = identity.ca
        self.client = ClientContexts(self.cluster)
        stack = self._stack
        self.store = await JobsStore.open(config.jobs_db)
        stack.push_async_callback(self.store.close)
        self.writer = await stack.enter_async_context(JobsWriter(self.store))
        if config.simulate_gpus:
            self.gpus = simulate(config.simulate_gpus, self.node_id)
        else:
            self.gpus = discover(self.node_id)
        if not self.gpus.devices:
            log.info("no GPU on this node: %s", self.gpus.reason)
        self.membership = Membership(self.node_id, unreachable_after_s=3 * config.heartbeat_s)
        self._generation = 0
        self.record = self._new_record()
        self.membership.offer(self.record, time.monotonic())
        for record in self._read_seeds():
            self.membership.offer(record, time.monotonic())
        self.supervisor = ManagerSupervisor(
            store=self.store,
            writer=self.writer,
            port=config.manager_port,
            cluster_dir=self.cluster.path,
            log_level=config.log_level,
            extra_env={"NVPAIR_WM_BIND": os.environ.get("NVPAIR_BIND", "")},
        )
        self.supervisor.set_peers(self._manager_peers())
        await self.supervisor.start()
        stack.push_async_callback(self.supervisor.aclose)
        bind = os.environ.get("NVPAIR_BIND") or None
        self.node_api = NodeApi(
            self.cluster,
            host=bind,
            port=config.node_port,
            on_push=self._on_push,
            on_admitted=self._on_admitted,
            records=self.membership.records,
        )
        await self.node_api.start()
        stack.push_async_callback(self.node_api.aclose)
        self.local_api = LocalApi(self, port=config.api_port)
        await self.local_api.start()
        stack.push_async_callback(self.local_api.aclose)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        stack.push_async_callback(self._session.close)
        # Engines and forwarded requests: no total timeout (a generation may be long), but a
        # connect timeout and a read timeout between chunks.
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300)
        )
        stack.push_async_callback(self.http.close)
        await self._probe_engines()
        self.facade = Facade(
            self,
            host=config.facade_bind or bind,
            port=config.facade_port,
            api_keys=dict(config.api_keys),
            queue_limit=config.queue_limit,
        )
        await self.facade.start()
        stack.push_async_callback(self.facade.aclose)
        self.node_api.run_here = self.facade.run_forwarded
        self.node_api.on_cordon = self.set_cordon
        self.node_api.on_cancel = self.facade.cancel_on
        tasks = await stack.enter_async_context(_TaskGroup())
        self._operation_tasks = tasks
        tasks.create_task(self._heartbeat())
        tasks.create_task(self._prune())
        tasks.create_task(self._watch_engines())
        tasks.create_task(self._watch_load())
        plane = plane_settings(config.home)
        self.plane_sync = PlaneSync(self, *plane) if plane else None
        if self.plane_sync is not None:
            tasks.create_task(self.plane_sync.run())
        config.state_file.write_text(
            json.dumps({"api": self.local_api.url, "pid": os.getpid(), "nodeId": self.node_id})
        )
        stack.callback(lambda: config.state_file.unlink(missing_ok=True))
        log.info("node %s (%s) up; local API %s", self.node_id, config.name, self.local_api.url)

    async def aclose(self) -> None:
        """Stop everything, the workload manager child included."""
        for push in self._pushes.values():
            push.cancel()
        await asyncio.gather(*self._pushes.values(), return_exceptions=True)
        await self._stack.aclose()

    # -- local operations (from the local API) --------------------------------------------------

    def submit(self, method: str, record: Workload) -> None:
        """A local lifecycle event: into our Jobs store and out to the cluster."""
        self.writer.upsert(record)
        self.supervisor.send_event(method, record)

    def remove_job(self, removal: RemoveEvent) -> None:
        """A local job removal."""
        self.writer.remove(removal)
        self.supervisor.send_removal(removal)

    def remove_member(self, node_id: str) -> None:
        """`nvpair cluster remove`: tombstone, unpin here, tell every member."""
        if node_id == self.node_id:
            raise PinRefused("a node cannot remove itself; run the removal on another member")
        removal = Removal(nodeId=node_id, removedAt=int(time.time() * 1000))
        self._apply_removals([removal])
        self._push_now.set()

    def nodes(self) -> list[dict[str, Any]]:
        """Every member's record with its reachability."""
        now = time.monotonic()
        return [
            {
                **msgspec.to_builtins(record),
                "reachable": self.membership.reachable(record.nodeId, now),
            }
            for record in self.membership.records()
        ]

    # -- records -----------------------------------------------------------------------------

    def _new_record(self) -> NodeRecord:
        # Generations come from the wall clock so they keep rising across restarts.
        now_ms = int(time.time() * 1000)
        self._generation = max(self._generation + 1, now_ms)
        return NodeRecord(
            nodeId=self.node_id,
            name=self.config.name,
            addresses=[self.config.advertise],
            managerPort=self.config.manager_port,
            nodePort=self.config.node_port,
            facadePort=self.config.facade_port,
            version=VERSION,
            devices=self.gpus.devices,
            domains=self.gpus.domains,
            engines=self.engines,
            queueLimit=self.config.queue_limit,
            cordoned=self.cordoned,
            gpuNote=self.gpus.reason,
            updatedAt=now_ms,
            generation=self._generation,
        )

    def _manager_peers(self) -> list[Peer]:
        return [
            Peer(nodeId=r.nodeId, host=r.addresses[0], port=r.managerPort)
            for r in self.membership.peers()
            if r.addresses and self.cluster.pins.is_member(r.nodeId)
        ]

    def _our_push(self) -> RecordsPush:
        return RecordsPush(
            records=self.membership.records(),
            removals=self.membership.removals(),
            certificates=[pem.decode() for pem in self.cluster.pins.pems()],
        )

    def _on_push(self, push: RecordsPush, sender: str) -> RecordsPush:
        self._merge(push)
        self.membership.heard_from(sender, time.monotonic())
        return self._our_push()

    async def _on_admitted(self) -> None:
        self._push_now.set()  # tell the members about the new pin at once

    def _merge(self, push: RecordsPush) -> None:
        before = self._manager_peers()
        self._apply_removals(push.removals)
        for pem in push.certificates:
            self._maybe_pin(pem)
        now = time.monotonic()
        for record in push.records:
            if record.nodeId == self.node_id:
                continue  # only this node speaks for itself
            if self.cluster.pins.is_member(record.nodeId):
                self.membership.offer(record, now)
        if self._manager_peers() != before:
            self.supervisor.set_peers(self._manager_peers())

    def _maybe_pin(self, pem: str) -> None:
        try:
            cert = load_cert(pem.encode())
            info = describe(cert)
        except (ValueError, CertsError):
            return
        if self.cluster.pins.is_member(info.node_id) or self.membership.is_removed(info.node_id):
            return
        if not verify_issued_by(cert, self.ca):
            log.warning("ignoring a member certificate for %s not signed by our CA", info.node_id)
            return
        try:
            self.cluster.pins.pin(cert, ca=self.ca)
            log.info("pinned new member %s (%s)", info.node_id, info.name)
        except PinRefused as exc:
            log.info("not pinning %s: %s", info.node_id, exc)

    def _apply_removals(self, removals: Iterable[Removal]) -> None:
        changed = False
        for removal in removals:
            if removal.nodeId == self.node_id:
                continue  # a removed node keeps its own view; the others stop talking to it
            if self.membership.remove(removal):
                changed = True
                if self.cluster.pins.is_member(removal.nodeId):
                    self.cluster.pins.unpin(removal.nodeId)
                    log.info("member %s removed", removal.nodeId)
        if changed:
            self.supervisor.set_peers(self._manager_peers())

    # -- operations -----------------------------------------------------------------------------

    def set_cordon(self, cordoned: bool) -> None:
        """Cordon (no new placements) or uncordon this node; members learn at once."""
        if cordoned != self.cordoned:
            self.cordoned = cordoned
            self.record = self._new_record()
            self.membership.offer(self.record, time.monotonic())
            self._push_now.set()
            log.info("node %s", "cordoned" if cordoned else "uncordoned")

    def start_operation(
        self, kind: str, target: str, *, reason: str, timeout_s: float | None, force: bool
    ) -> Operation:
        """Begin a cordon, uncordon or drain; it runs in the background."""
        if kind not in ("cordon", "uncordon", "drain"):
            raise ValueError("an operation is cordon, uncordon or drain")
        if target != self.node_id and self.membership.record(target) is None:
            raise ValueError(f"{target} is not a member this node knows")
        operation = Operation(kind, target, self.config.name, reason, timeout_s, force)
        self.operations[operation.id] = operation
        while len(self.operations) > MAX_OPERATIONS:
            del self.operations[next(iter(self.operations))]
        self._operation_tasks.create_task(self._run_operation(operation))
        return operation

    async def _run_operation(self, op: Operation) -> None:
        op.move(Phase.RUNNING)
        try:
            await self._cordon(op.target, op.kind != "uncordon")
            if op.kind != "drain":
                op.move(Phase.SUCCEEDED, f"{op.target} {op.kind}ed")
                return
            deadline = None if op.timeout_s is None else time.monotonic() + op.timeout_s
            while True:
                await self.writer.flush()
                active = await self.store.active_on(op.target)
                if not active:
                    op.move(Phase.SUCCEEDED, "drained: no job runs there")
                    return
                op.waiting_for = f"{len(active)} job(s) on {op.target}: {', '.join(active[:10])}"
                if deadline is not None and time.monotonic() > deadline:
                    if not op.force:
                        op.move(Phase.FAILED, f"timed out; still waiting for {op.waiting_for}")
                        return
                    await self._cancel_everywhere(op.target)
                    deadline = None
                    op.result = f"cancelled {len(active)} job(s) past the timeout"
                await asyncio.sleep(0.5)
        except Exception as exc:
            log.warning("operation %s failed: %s", op.id, exc)
            op.move(Phase.FAILED, f"{type(exc).__name__}: {exc}")

    async def _cordon(self, target: str, cordoned: bool) -> None:
        if target == self.node_id:
            self.set_cordon(cordoned)
            return
        record = self.membership.record(target)
        assert record is not None
        async with self._session.post(
            f"https://{_host(record.addresses[0])}:{record.nodePort}/v1/cordon",
            json={"cordoned": cordoned},
            ssl=self.client.current(),
            server_hostname=server_hostname_for(target),
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"{target} answered {response.status}")

    async def _cancel_everywhere(self, target: str) -> None:
        self.facade.cancel_on(target)
        for record in self.membership.peers():
            if not record.addresses or not self.cluster.pins.is_member(record.nodeId):
                continue
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with self._session.post(
                    f"https://{_host(record.addresses[0])}:{record.nodePort}/v1/cancel",
                    json={"target": target},
                    ssl=self.client.current(),
                    server_hostname=server_hostname_for(record.nodeId),
                ) as response:
                    await response.read()

    # -- inference ------------------------------------------------------------------------------

    def scheduling_view(self) -> tuple[Cluster, Load]:
        """The cluster as the scheduler sees it now, and the pending work per node.

        Compiled again only when a record, a reachability or the pins change (and at most
        every VIEW_TTL_S for reachability, which moves with time); the load is copied fresh
        on every call, since the caller adds to it.
        """
        now = time.monotonic()
        cached = self._view_cache
        key = tuple((r.nodeId, r.generation) for r in self.membership.records())
        if cached is None or cached[0] != key or now - cached[1] > VIEW_TTL_S:
            cached = self._view_cache = (key, now, self._compile_view(now))
        cluster = cached[2]
        return cluster, Load.of(cluster, self._remote_load)

    def _compile_view(self, now: float) -> Cluster:
        views = []
        for record in self.membership.records():
            views.append(
                NodeView(
                    record.nodeId,
                    member=record.nodeId == self.node_id
                    or self.cluster.pins.is_member(record.nodeId),
                    reachable=self.membership.reachable(record.nodeId, now),
                    cordoned=record.cordoned,
                    queue_limit=record.queueLimit,
                    engines=tuple(
                        EngineView(e.name, e.kind, frozenset(e.models), e.up)
                        for e in record.engines
                    ),
                    devices=tuple(
                        DeviceView(
                            d.memoryFree,
                            d.memoryTotal,
                            float(d.utilization or 0),
                            d.health == "ok",
                            d.domainId or "none",
                            d.deviceClass,
                        )
                        for d in record.devices
                    ),
                )
            )
        return Cluster.compile(views)

    def engine_kind_for(self, node_id: str, model: str) -> str:
        """The kind of the engine that serves `model` on `node_id` (for the job record)."""
        record = self.record if node_id == self.node_id else self.membership.record(node_id)
        for engine in record.engines if record else []:
            if model in engine.models and engine.up:
                return engine.kind
        return "unknown"

    def engine_url_for(self, model: str) -> str | None:
        """A local engine that serves `model` and is up."""
        for engine in self.engines:
            if model in engine.models and engine.up:
                return engine.url
        return None

    def forward(self, node_id: str, path: str, body: bytes) -> Any:
        """POST a request to a member's node API to run there; an aiohttp request context."""
        record = self.membership.record(node_id)
        if record is None or not record.addresses:
            raise aiohttp.ClientConnectionError(f"no address for {node_id}")
        return self.http.post(
            f"https://{_host(record.addresses[0])}:{record.nodePort}/v1/forward",
            data=body,
            headers={"Content-Type": "application/json", "X-Nvpair-Path": path},
            ssl=self.client.current(),
            server_hostname=server_hostname_for(node_id),
        )

    async def _probe_engines(self) -> None:
        engines = []
        for name, kind, url in self.config.engines:
            try:
                async with self._session.get(url + "/v1/models") as response:
                    listed = await response.json() if response.status == 200 else {}
                models = [str(m["id"]) for m in listed.get("data", []) if isinstance(m, dict)]
                engines.append(Engine(name=name, kind=kind, url=url, models=models[:4096], up=True))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError):
                engines.append(Engine(name=name, kind=kind, url=url, models=[], up=False))
        if engines != self.engines:
            self.engines = engines
            self._push_now.set()

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_PROBE_S)
            await self._probe_engines()

    async def _watch_load(self) -> None:
        # Others' running jobs by node, from the shared Jobs view; the facade adds its own.
        while True:
            await self.writer.flush()
            self._remote_load = await self.store.running_by_node(exclude_origin=self.node_id)
            await asyncio.sleep(LOAD_REFRESH_S)

    # -- background -----------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        beats = 0
        while True:
            beats += 1
            if not self.config.simulate_gpus and beats % GPU_REFRESH_BEATS == 0:
                # Memory in use and utilisation move; NVML calls block, so off the loop.
                self.gpus = await asyncio.to_thread(discover, self.node_id)
            self.record = self._new_record()
            self.membership.offer(self.record, time.monotonic())
            peers = [r for r in self.membership.peers() if self.cluster.pins.is_member(r.nodeId)]
            # One push in flight per peer, not in lockstep: a peer that is down and times
            # out must not hold back the heartbeat to the others (they would see us flap).
            for peer in peers:
                pending = self._pushes.get(peer.nodeId)
                if pending is None or pending.done():
                    self._pushes[peer.nodeId] = asyncio.create_task(self._push_to(peer))
            for node_id in [n for n, t in self._pushes.items() if t.done()]:
                del self._pushes[node_id]
            self._push_now.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_s):
                    await self._push_now.wait()

    async def _push_to(self, peer: NodeRecord) -> None:
        if not peer.addresses:
            return
        url = f"https://{_host(peer.addresses[0])}:{peer.nodePort}/v1/records"
        try:
            async with self._session.post(
                url,
                data=msgspec.json.encode(self._our_push()),
                headers={"Content-Type": "application/json"},
                ssl=self.client.current(),
                server_hostname=server_hostname_for(peer.nodeId),
            ) as response:
                body = await response.read()
                if response.status != 200:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status
                    )
            self._merge(push_decoder.decode(body))
            self.membership.heard_from(peer.nodeId, time.monotonic())
            self.pushes_ok += 1
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError, CertsError) as exc:
            self.pushes_failed += 1
            log.debug("record push to %s failed: %s", peer.nodeId, exc)

    async def _prune(self) -> None:
        retention_ms = int(self.config.job_retention_h * 3600 * 1000)
        while True:
            await asyncio.sleep(300)
            now = time.time()
            pruned = await self.store.prune(
                older_than_ms=int(now * 1000) - retention_ms, removed_before=now - 86_400
            )
            if pruned:
                log.info("pruned %d finished jobs past the retention", pruned)

    def _read_seeds(self) -> list[NodeRecord]:
        path = self.config.home / SEEDS_FILE
        if not path.exists():
            return []
        try:
            return msgspec.json.decode(path.read_bytes(), type=list[NodeRecord])
        except msgspec.DecodeError as exc:
            log.warning("ignoring %s: %s", path, exc)
            return []


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class _TaskGroup:
    """An asyncio.TaskGroup whose tasks are cancelled on exit, for an AsyncExitStack."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def create_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def __aenter__(self) -> _TaskGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
