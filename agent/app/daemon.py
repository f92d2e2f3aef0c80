"""The node daemon (`nvpair agent run`): the composition root.

It builds the parts, wires each to the few callables it needs, starts them in order and
stops them in reverse; it holds no policy of its own. Each area has a small builder that
returns its parts, built only from parts that already exist; where an earlier part must
tell a later one that something changed (an engine moved: push the record), it fires a
`Nudge` the later part follows once built. The parts:

- the Jobs store and its group-commit writer (`broker.jobs`);
- the workload manager child (`broker.supervisor`), told its peers by `Members`;
- `Members` (records, pins, tombstones; policy in `facts.membership`) and `Heartbeat`
  (this node's own record, pushed to every member through `NodeClient`);
- `Engines` (probed model servers), `SchedulingView`, `LoadPoller`, `Pruner`;
- the servers: node API (mTLS), local API (loopback), facade;
- `Operations` (cordon, drain) and, when enrolled in a plane, its `PlaneLink`.

Every background task belongs to `Tasks`; a task that dies marks its part failing in
`Health`, which `/healthz` reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import time
from collections.abc import Awaitable
from typing import Any, Final

from cryptography.hazmat.primitives.serialization import Encoding

from agent.apis.artifacts import artifact_routes
from agent.apis.deployments import DeployPorts
from agent.apis.local import LocalApi, LocalPorts
from agent.apis.local_guard import issue_token
from agent.apis.node import NodeApi
from agent.apis.page import UiPorts
from agent.apis.routing import routing_routes
from agent.apis.usage import usage_routes
from agent.app.upkeep import LoadPoller, Pruner, gpu_reader
from agent.artifacts.fetches import Fetches
from agent.artifacts.store import ArtifactStore
from agent.artifacts.weights import StoreWeights
from agent.cluster.api_keys import ApiKeys
from agent.cluster.artifacts import Artifacts
from agent.cluster.deployments import Deployments
from agent.cluster.heartbeat import Heartbeat, NodeState, OwnRecord
from agent.cluster.members import SEEDS_FILE, Members, read_seeds
from agent.cluster.node_client import NodeClient
from agent.cluster.operations import Operations
from agent.cluster.repair import AntiEntropy
from agent.cluster.scaler import Scaler
from agent.config import AgentConfig, port_in_use
from agent.core.errors import StartupError
from agent.core.home import forget_state
from agent.core.lifetime import Health, Tasks
from agent.core.nudge import Nudge
from agent.engines.auth import EngineAuth
from agent.engines.gpus import node_inventory
from agent.engines.registry import Engines
from agent.engines.replicas import ReplicaControl
from agent.engines.supervisor import EngineSupervisor
from agent.engines.weights import Weights
from agent.metrics.artifacts import ArtifactMetrics
from agent.metrics.serving import serving_metrics
from agent.metrics.traces import TraceMetrics, start_tracing
from agent.plane_link.link import PlaneParts, plane_link, plane_routes
from agent.serving.cluster_limits import ClusterLimits
from agent.serving.facade import Facade, facade_address
from agent.serving.key_check import KeyCheck
from agent.serving.routing import Target
from agent.serving.run_book import open_run_book
from agent.serving.usage_book import UsageBook
from agent.serving.usage_metrics import known_to
from agent.serving.view import ReplicaViews, SchedulingView
from agent.serving.wait_queue import WaitQueue
from broker.errors import ManagerPortInUse
from broker.jobs import JobsStore, JobsWriter
from broker.supervisor import ManagerSupervisor
from certs import ClusterDir, write_atomic
from certs.cluster_dir import Identity
from facts import wire
from facts.kept import Kept
from facts.record_signing import sign_record, sign_removal, sign_speaks, sign_statement
from facts.records import RecordsPush
from facts.wire import Speaks
from scheduler.prefix import anchor_key
from workload_manager.workload import METHOD_FOR_STATE, Workload, WorkloadRemoval

__all__ = ["Agent"]

log = logging.getLogger(__name__)

CLOSE_BOUND_S: Final = 8.0  # `aclose()` gives up waiting after this, whatever failed


class Agent:
    """One node. `start()` brings everything up; `aclose()` takes it down in order."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.cluster = ClusterDir(config.cluster_dir)
        self.started_at = time.time()
        self.health = Health()
        self._up = False  # /healthz is 503 "starting" until every part is started
        self.health.watch("start", lambda: None if self._up else "starting")
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        """Bring the node up. Raises `CertsError` without a cluster identity, `PortInUse`
        when a port is taken; whatever started before the failure is stopped again."""
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise

    @staticmethod
    def _speaks(node_id: str) -> Speaks:
        """What this member speaks: this release's range (docs/upgrade.md), or the one
        `NVPAIR_TEST_SPEAKS` names (`0.3.0:2-3`: a stand-in for another release in the
        mixed-release tests; never set it on a member that serves)."""
        speaks = wire.Range(wire.RELEASE, wire.WIRE_MIN, wire.WIRE_MAX)
        override = os.environ.get("NVPAIR_TEST_SPEAKS")
        if override:
            try:
                speaks = wire.parse_range(override)
            except ValueError as exc:
                raise StartupError(f"NVPAIR_TEST_SPEAKS: {exc}") from None
            log.warning("NVPAIR_TEST_SPEAKS: this member says it speaks %s", wire.describe(speaks))
        return Speaks(
            nodeId=node_id,
            release=speaks.release,
            wireMin=speaks.low,
            wireMax=speaks.high,
            at=int(time.time() * 1000),
        )

    async def _start(self) -> None:
        config, stack, health = self.config, self._stack, self.health
        identity = self.cluster.load_identity()
        self.node_id = node_id = identity.node.node_id
        bind = os.environ.get("NVPAIR_BIND") or None
        traces = start_tracing(config.tracing, node_id, config.name, stack)  # [tracing]
        # Fired by parts built before the ones that follow them (agent/core/nudge.py).
        record_changed = Nudge("record-changed")  # this node's record: push it at once
        loads_moved = Nudge("loads-moved")  # other members' loads: waiting requests look
        declared_changed = Nudge("declared-changed")  # a deployment: the replicas, a round now

        self.store, self.writer, usage = store, writer, usage = await self._stores()
        self.supervisor = supervisor = self._manager(bind)
        deployments, api_keys = self._cluster_facts(
            identity, record_changed, usage, declared_changed
        )
        speaks = self._speaks(node_id)
        artifacts = Artifacts(  # weights, by digest: facts like deployments (issue 28)
            config.home,
            sign=lambda a: sign_statement(a, identity.key, identity.cert),
            on_change=record_changed,
        )
        self.members = members = Members(
            self.cluster,
            self_id=node_id,
            ca=identity.ca,
            unreachable_after_s=3 * config.heartbeat_s,
            set_peers=supervisor.set_peers,
            sign=lambda removal: sign_removal(removal, identity.key, identity.cert),
            deployments=deployments,
            api_keys=api_keys,
            on_records=usage.metrics.sync,  # an engine's model came or went
            speaks=Kept.made(sign_speaks(speaks, identity.key)),
            artifacts=artifacts,
        )
        client = NodeClient(self.cluster, members.record, dial_from=config.dial_from)
        stack.push_async_callback(client.aclose)
        here = NodeState(node_inventory(node_id, config.simulate_gpus))
        tasks = Tasks(health)
        artifact_store = ArtifactStore(config.artifacts_path)
        fetches = Fetches(
            artifact_store,
            lambda: [n for n in members.reachable_peers() if members.works_with(n)],
            client,
            tasks.spawn,
            budget=config.artifacts.max_bytes,
            max_rate=config.artifacts.max_rate,
        )
        ca_file = config.artifacts.ca_file
        weights = StoreWeights(
            artifacts, fetches, ca_file=config.home / ca_file if ca_file else None
        )
        engines, control = self._engine_parts(deployments, here, record_changed, weights, client)
        # Never evicted: what replicas here load, and the warm set.
        fetches.pinned = lambda: control.weights_in_use() | {a.digest for a in weights.warm()}
        # The wait line: the facade's, read by the record too (what waits here, per model).
        waits: WaitQueue[Target] = WaitQueue(length=config.wait[0], timeout_s=config.wait[1])
        self.own = own = OwnRecord(
            config,
            node_id,
            here,
            lambda: engines.current,
            sign=lambda record: sign_record(record, identity.key),
            replicas=control.replicas,
            release=speaks.release,
            holdings=weights.holdings,
            waiting=waits.line.lengths,
            features=lambda: members.gate().on,
        )
        members.offer([own.current, *read_seeds(config.home / SEEDS_FILE)])
        heartbeat = Heartbeat(
            own=own,
            members=members,
            client=client,
            interval_s=config.heartbeat_s,
            read_gpus=None if config.simulate_gpus else gpu_reader(node_id),
        )
        record_changed.follow(heartbeat.push_now)
        declared_changed.follow(control.poke)
        load = LoadPoller(self._remote_load, on_refresh=loads_moved)
        view, facade = self._serving(
            bind, members, engines, control, deployments, api_keys, client, usage, load, waits
        )
        facade.anchor_key = anchor_key(identity.ca.public_bytes(Encoding.DER))
        loads_moved.follow(facade.waits.poke)
        heartbeat.on_renewed = facade.waits.poke  # a replica here ready: waiting ones look
        scaler = Scaler(
            self_id=node_id,
            deployments=deployments,
            records=members.working_records,
            waiting_here=waits.line.lengths,
            holders=lambda: [node_id, *members.reachable_peers_working()],
            members=lambda: 1 + len(members.peers()),
            enabled=lambda: members.gate().allows("elastic-deployments"),
        )

        def line_started(model: str) -> None:
            # A cold start: the members hear of this line now (the decider may be another
            # member), and this member decides now if it decides.
            if scaler.cold_line(model):
                record_changed()
                scaler.wake()

        waits.on_start = line_started

        def pushed(push: RecordsPush, sender: str) -> RecordsPush:
            try:
                return members.on_push(push, sender)
            finally:
                waits.poke()  # load reports came: the heads of the wait lines look again
                scaler.pushed(members.record(sender))  # a cold start's line: decide now

        runs = await open_run_book(config.runs_file, store, node_id, facade.jobs.run_id)
        self.operations = operations = Operations(
            self_id=node_id,
            requester=config.name,
            is_known=lambda target: members.record(target) is not None,
            cordon_here=heartbeat.set_cordon,
            cordon_member=client.cordon,
            active_on=self._active_on,
            cancel_here=facade.cancel_on,
            cancel_member=client.cancel,
            peers=lambda: [r.nodeId for r in members.peers()],
            spawn=tasks.spawn,
        )
        repair = AntiEntropy(
            node_id=node_id,
            store=store,
            writer=writer,
            peers=members.reachable_peers,
            digest_at=client.repair_digest,
            exchange_at=client.repair_exchange,
            retention_h=config.job_retention_h,
            interval_s=config.anti_entropy_s,
            relay=lambda record: supervisor.send_event(METHOD_FOR_STATE[record.state], record),
            relay_removal=supervisor.send_removal,
            own_run=runs.holds,  # only rows of its own runs are asked back
        )
        node_api = NodeApi(
            self.cluster,
            host=bind,
            port=config.node_port,
            on_push=pushed,
            on_admitted=heartbeat.push_now,  # tell the members about the new pin at once
            records=members.membership.kept_records,
            refusal=members.refusal,
            run_here=facade.run_forwarded,
            on_cordon=heartbeat.set_cordon,
            on_cancel=facade.cancel_on,
            on_digest=repair.answer_digest,
            on_exchange=repair.answer_exchange,
            api_keys=api_keys.held.kept,
            probes=heartbeat.probes,
            artifacts=artifact_store,
            artifact_pace=fetches.serve_pace,
            artifact_counters=fetches.counters,
            on_lease=None if facade.keys.cluster is None else facade.keys.cluster.answer,
            tunnel=control.tunnels.serve,
        )
        link = plane_link(
            config.plane,
            home=config.home,
            identity=identity,
            store=store,
            writer=writer,
            record=lambda: own.current,
            usage=usage.store,
            parts=PlaneParts(
                deployments, operations, facade, members, control, weights, scaler.events
            ),
        )

        def remove_member(target: str) -> None:
            members.remove(target)
            heartbeat.push_now()

        self.local_api = local_api = LocalApi(
            LocalPorts(
                node_id=node_id,
                name=config.name,
                started_at=self.started_at,
                health=health,
                manager=supervisor,
                store=store,
                writer=writer,
                members=members,
                pins=self.cluster.pins,
                view=view,
                operations=operations,
                gpus=lambda: here.gpus,
                submit=self.submit,
                remove_job=self.remove_job,
                remove_member=remove_member,
                record_run=runs.remember,
                plane=lambda: None if link is None else link.counters(),
                repairs=lambda: dataclasses.asdict(repair.counters),
                deployments=DeployPorts(
                    deployments,
                    control,
                    members,
                    facade.pending,
                    weights,
                    scaler.explain,
                    scaler.events,
                ),
                routes=[
                    *usage_routes(usage),
                    *plane_routes(link),
                    *artifact_routes(weights, members.records),
                    *routing_routes(facade),
                ],
                ui=UiPorts.following(store, usage.store),  # the web page's feed and usage
            ),
            port=config.api_port,
            token=issue_token(config.home),  # fresh each start, on disk before it listens
        )

        # Closed in reverse: background loops first, then the facade (its requests end and
        # their jobs are told while the manager still runs), the APIs, then the manager.
        stack.push_async_callback(supervisor.aclose)
        # Bind every port before anything talks to the network, so a port in use ends the
        # start at once; the manager's port is the child's, checked as it starts.
        stack.push_async_callback(node_api.aclose)
        await _bind("node_port", config.node_port, node_api.start())
        stack.push_async_callback(local_api.aclose)
        await _bind("api_port", config.api_port, local_api.start())
        stack.push_async_callback(facade.aclose)
        await _bind("facade_port", config.facade_port, facade.start())
        log.info(
            "facade listening on %s:%d (%s)", facade.host or "*", facade.port, self._facade_why
        )
        stack.push_async_callback(tasks.aclose)
        supervisor.set_peers(members.manager_peers())
        try:
            await supervisor.start()
        except ManagerPortInUse:
            raise port_in_use("manager_port", config.manager_port) from None
        await engines.probe()  # engines in the first record, before requests are placed
        await control.start()  # what a previous agent left running, adopted or stopped
        stack.push_async_callback(control.aclose)
        stack.push_async_callback(control.scraper.aclose)

        tasks.spawn("heartbeat", heartbeat.run())
        tasks.spawn("engines", engines.run())
        tasks.spawn("load", load.run())
        tasks.spawn("replicas", control.run())
        tasks.spawn("scaler", scaler.run())
        tasks.spawn("engine-load", control.scraper.run())
        pruner = Pruner(
            lambda older_ms, before: store.prune(older_than_ms=older_ms, removed_before=before),
            retention_h=config.job_retention_h,
        )
        tasks.spawn("prune", pruner.run())
        tasks.spawn("anti-entropy", repair.run())
        if facade.keys.cluster is not None:
            tasks.spawn("key-limits", facade.keys.cluster.run())
        tasks.spawn("artifacts-warm", weights.keep_warm())
        for name, loop in ({} if link is None else link.loops).items():
            tasks.spawn(name, loop())
        local_api.registry.register(usage.metrics)
        local_api.registry.register(serving_metrics(facade, control, deployments, view, scaler))
        local_api.registry.register(ArtifactMetrics(fetches.counters, fetches.running))
        local_api.registry.register(TraceMetrics(traces))
        self._write_state(local_api.url)
        self._up = True  # the engines probed, the manager up: requests are placed from here
        log.info("node %s (%s) up; local API %s", node_id, config.name, local_api.url)

    # -- the builders: each returns its area's parts, built from parts that exist --------------

    async def _stores(self) -> tuple[JobsStore, JobsWriter, UsageBook]:
        """The Jobs store, its group-commit writer and the usage book, closed by the stack."""
        config, stack, health = self.config, self._stack, self.health
        store = await JobsStore.open(config.jobs_db)
        stack.push_async_callback(store.close)
        writer = await stack.enter_async_context(JobsWriter(store))
        health.watch("jobs-store", writer.problem)
        usage = await stack.enter_async_context(UsageBook(config.jobs_db, config.job_retention_h))
        health.watch("usage-store", lambda: usage.store.problem)
        return store, writer, usage

    def _manager(self, bind: str | None) -> ManagerSupervisor:
        """The workload manager child's supervisor (started later, after the ports bind)."""
        config = self.config
        supervisor = ManagerSupervisor(
            store=self.store,
            writer=self.writer,
            port=config.manager_port,
            cluster_dir=self.cluster.path,
            log_level=config.log_level,
            extra_env={"NVPAIR_WM_BIND": bind or "", "NVPAIR_WM_DIAL_FROM": config.dial_from or ""},
        )
        self.health.watch("workload-manager", supervisor.problem)
        return supervisor

    def _cluster_facts(
        self, identity: Identity, record_changed: Nudge, usage: UsageBook, declared: Nudge
    ) -> tuple[Deployments, ApiKeys]:
        """The signed deployments and API keys; one changing is in the next push at once,
        and its series in /metrics at zero before its first request; a deployment changing
        fires `declared` too (the replica controller's round: a scale-up starts now)."""

        def known_changed() -> None:
            record_changed()
            usage.metrics.sync()

        def deployment_changed() -> None:
            known_changed()
            declared()

        deployments = Deployments(
            self.config.home,
            sign=lambda d: sign_statement(d, identity.key, identity.cert),
            on_change=deployment_changed,
        )
        return deployments, ApiKeys.signed_by(identity, self.config.home, known_changed)

    def _engine_parts(
        self, deployments: Deployments, here: NodeState, nudge: Nudge, weights: Weights, client: Any
    ) -> tuple[Engines, ReplicaControl]:
        """The engine registry, and the replica controller over the engine supervisor (with its
        load scraper, and its tunnels through `client`); a change `nudge`s the next record."""
        config, members = self.config, self.members
        stack, launch = self._stack, config.launch
        auth = self.engine_auth = EngineAuth(config.engine_credentials)  # every engine call
        engines = Engines(config.engines, on_change=nudge, auth=auth)
        stack.push_async_callback(engines.aclose)
        engines_moved = Nudge("engines-moved")  # a replica's engine: a round soon
        engines_moved.follow(nudge)
        engine_supervisor = EngineSupervisor(
            config.home,
            templates={t.name: t for t in launch.templates},
            port_range=launch.port_range,
            stop_grace_s=launch.stop_grace_s,
            on_change=engines_moved,
        )
        control = ReplicaControl(
            config.home,
            self_id=self.node_id,
            supervisor=engine_supervisor,
            deployments=deployments.live,
            records=members.working_records,
            reachable=lambda n: members.reachable(n, time.monotonic()),
            gpus=lambda: here.gpus,
            cordoned=lambda: here.cordoned,
            name=config.name,
            auth=auth,
            on_change=nudge, weights=weights, dial=client.tunnel,
            trusted_network=launch.trusted_network,
        )  # fmt: skip
        engines_moved.follow(control.engines_changed)
        return engines, control

    def _serving(
        self,
        bind: str | None,
        members: Members,
        engines: Engines,
        control: ReplicaControl,
        deployments: Deployments,
        api_keys: ApiKeys,
        client: NodeClient,
        usage: UsageBook,
        load: LoadPoller,
        waits: WaitQueue[Target],
    ) -> tuple[SchedulingView, Facade]:
        """The scheduling view, the API-key check and the OpenAI-compatible facade."""
        config, node_id = self.config, self.node_id
        view = SchedulingView(
            self_id=node_id,
            records=members.working_records,
            record_of=members.record,
            is_member=members.is_member,
            reachable=members.reachable,
            remote_load=lambda: load.remote,
        )
        keys = KeyCheck(dict(config.api_keys), api_keys, members_alive=members.alive)
        keys.cluster = ClusterLimits(
            self_id=node_id,
            limiter=keys.limiter,
            limits_of=keys.limits_of,
            holders=lambda: [node_id, *members.reachable_peers_working()],
            members=lambda: 1 + len(members.peers()),
            members_alive=members.alive,
            enabled=lambda: members.gate().allows("cluster-key-limits"),
            ask=client.lease,
        )
        usage.metrics.follow(known_to(deployments, view, keys))
        host, self._facade_why = facade_address(config.facade_bind, bind, keys.in_use())
        self.facade = facade = Facade(
            node_id=node_id,
            view=view,
            engines=engines,
            forward=client.forward,
            replicas=ReplicaViews(
                self_id=node_id,
                records=members.working_records,
                reachable=members.reachable,
                deployment_of=deployments.get,
            ).current,
            replica_url=control.url_of,
            submit=self.submit,
            host=host,
            port=config.facade_port,
            api_keys=dict(config.api_keys),
            key_check=keys,
            queue_limit=config.queue_limit,
            waits=waits,
            elastic=lambda: {
                d.name: d.scaling.cold_start_s for d in deployments.live() if d.scaling is not None
            },
            on_usage=usage.record,
            policy=config.routing.policy,
        )
        return view, facade

    async def aclose(self) -> None:
        """Stop everything, the workload manager child included, within a bound."""
        try:
            async with asyncio.timeout(CLOSE_BOUND_S):
                await self._stack.aclose()
        except TimeoutError:
            log.error("the agent did not stop within %.0fs; leaving anyway", CLOSE_BOUND_S)

    # -- the few things parts share -----------------------------------------------------------

    def submit(self, method: str, record: Workload) -> None:
        """A local lifecycle event: into our Jobs store and out to the cluster."""
        self.writer.upsert(record)
        self.supervisor.send_event(method, record)

    async def remove_job(self, removal: WorkloadRemoval) -> None:
        """A local removal: out to the cluster and into our Jobs store, committed there on
        return (`StoreUnavailable` when it cannot be in time; it is still kept)."""
        self.supervisor.send_removal(removal)
        await self.writer.remove_durable(removal)

    async def _remote_load(self) -> dict[str, int]:  # others' placed jobs, by node
        await self.writer.flush()
        return await self.store.running_by_node(exclude_origin=self.node_id)

    async def _active_on(self, target: str) -> list[str]:
        await self.writer.flush()
        return await self.store.active_on(target)

    def _write_state(self, api_url: str) -> None:
        state = self.config.state_file
        about = {"api": api_url, "pid": os.getpid(), "nodeId": self.node_id}
        write_atomic(state, json.dumps(about).encode())  # 0600: where the CLI sends its calls
        self._stack.callback(forget_state, state)


async def _bind(setting: str, port: int, start: Awaitable[Any]) -> None:
    try:
        await start
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise port_in_use(setting, port) from None
        raise
