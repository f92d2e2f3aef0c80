"""The local API on 127.0.0.1:14322 (loopback only): what the CLI and the web page read.

- `GET /healthz` -- the node, its workload manager child, uptime; 200 while every part is
  well, 503 with `failing: [{part, error}]` naming each part that is not.
- `GET /v1/jobs?state=&node=&limit=` -- the Jobs list, newest first (503 while the Jobs
  store cannot take writes: what was handed in is not all on disk yet). With `page=1` or
  `after=CURSOR` the answer is `{jobs, next}`: follow `next` (null after the last page) to
  read the whole list; a cursor this node did not give out is a 400.
- `POST /v1/jobs/{id}/remove` -- remove a job this node originated (`workloads:remove`,
  seed 002), answered once committed here; a job another node originated is a 400.
- `GET /v1/manager` -- `{supervisor, status}`: the supervisor's view (state, restarts,
  frames dropped) and the manager's `manager:status` (503 when it does not answer).
- `GET /v1/nodes` -- every member's record with `reachable`.
- `GET /v1/members` -- the pins: node id, name, pin, added, removed, removedBy.
- `GET /metrics` -- Prometheus text format (prometheus-client).
- `POST /v1/jobs/events` -- enter a lifecycle event of this node's own (`{method, params:
  {workloadInfo}}`; another node's is a 400); the facade does this in-process, this route is
  for operators and tests. The 202 comes once the record is committed in this node's Jobs
  store and its run is in the run book (`agent.serving.run_book`; 503 when either cannot be
  in time).
- `POST /v1/members/{node_id}/remove` -- `nvpair cluster remove`.
- `GET /v1/explain?model=`, `GET /v1/ops`, `POST /v1/ops` -- the scheduler's ranking, and
  cordon / uncordon / drain operations.
- The web page (`/ui/`, its login, `GET /v1/jobs/stream`, `/v1/jobs/counts`,
  `/v1/usage/series`) and the security headers on every answer: `agent.apis.page`.

It reads and asks the node's parts only through `LocalPorts`.

Only the loopback interface is bound, and that is no boundary by itself: every request
passes `local_guard.refusal` first (its own Host and Origin, the token from
`NVPAIR_HOME/local-api.token` or the page's session on all but `/healthz`, `/metrics` and
`/ui/login`, JSON bodies), refused with a JSON `{error}` (HTML on the page's paths) and
nothing done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from agent.apis.answers import bad_request, decoded, json_answer, read_json
from agent.apis.deployments import DeployPorts, deployment_routes
from agent.apis.page import UiPorts, UiServer
from agent.cluster.members import Members, remover
from agent.cluster.operations import OperationRefused, Operations
from agent.core.lifetime import SHUTDOWN_S, Health
from agent.metrics.agent import STATES, AgentMetrics
from agent.serving.run_book import RunNotRecorded
from agent.serving.view import SchedulingView
from broker.errors import BrokerError, InvalidCursor, StoreUnavailable
from broker.jobs import JobsStore, JobsWriter
from broker.supervisor import ManagerSupervisor
from certs import CertsError, PinStore
from facts.inventory import GpuInventory
from netkit.sites import start_runner
from scheduler import Request, rank
from workload_manager.workload import (
    LIFECYCLE_METHODS,
    LifecycleParams,
    WorkloadRemoval,
    lifecycle_mismatch,
)

__all__ = ["LocalApi", "LocalPorts"]

_STATES: Final = STATES
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_event_decoder: Final = msgspec.json.Decoder(dict[str, Any])
_params_decoder: Final = msgspec.json.Decoder(LifecycleParams)
_ELSEWHERE: Final = "originatedFrom {!r} is not this node: only a node speaks for its own jobs\n"


@dataclass(frozen=True)
class LocalPorts:
    """What the local API reads and asks of the node's parts."""

    node_id: str
    name: str
    started_at: float
    health: Health
    manager: ManagerSupervisor
    store: JobsStore
    writer: JobsWriter
    members: Members
    pins: PinStore
    view: SchedulingView
    operations: Operations
    gpus: Callable[[], GpuInventory]
    submit: Callable[[str, Any], None]
    remove_job: Callable[[WorkloadRemoval], Awaitable[None]]  # returns once committed here
    remove_member: Callable[[str], None]
    record_run: Callable[[str], Awaitable[None]]  # into the run book (`RunNotRecorded`)
    plane: Callable[[], dict[str, Any] | None] = lambda: None
    repairs: Callable[[], dict[str, int]] = dict
    deployments: DeployPorts | None = None  # the deployment routes' parts
    routes: Sequence[web.RouteDef] = ()  # the parts' own routes (`POST /v1/usage`)
    ui: UiPorts | None = None  # the web page's feed and usage (`agent.apis.page`)


class LocalApi:
    """aiohttp server bound to 127.0.0.1."""

    def __init__(self, ports: LocalPorts, *, port: int, token: str) -> None:
        self.ports = ports
        self.port = port
        self._token = token
        self.registry = CollectorRegistry()
        self.collector = AgentMetrics(
            ports.gpus,
            lambda: ports.manager.restarts,
            ports.plane,
            dropped=lambda: ports.manager.dropped,
            redundant=lambda: ports.writer.redundant,
            repairs=ports.repairs,
            writer_pending=lambda: ports.writer.pending,
        )
        self.registry.register(self.collector)
        app = web.Application(client_max_size=1024 * 1024, middlewares=[self._guard])
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/v1/jobs", self._jobs)
        app.router.add_get("/v1/nodes", self._nodes)
        app.router.add_get("/v1/cluster/status", self._cluster_status)
        app.router.add_get("/v1/members", self._members)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/explain", self._explain)
        app.router.add_get("/v1/ops", self._ops)
        app.router.add_post("/v1/ops", self._start_op)
        app.router.add_post("/v1/jobs/events", self._event)
        app.router.add_post("/v1/jobs/{id}/remove", self._remove_job)
        app.router.add_get("/v1/manager", self._manager)
        app.router.add_post("/v1/members/{node_id}/remove", self._remove)
        if ports.deployments is not None:
            app.router.add_routes(deployment_routes(ports.deployments, ports.members.records))
        app.router.add_routes(ports.routes)
        self.ui = UiServer(app, ports.ui, store=ports.store, writer=ports.writer, token=token)
        self._acks: set[asyncio.Task[None]] = set()  # events waiting for their commit
        self._app = app
        self._runner: web.AppRunner | None = None  # while serving

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Bind 127.0.0.1 and serve (OSError when the port is in use)."""
        self._runner, self.port = await start_runner(
            self._app, "127.0.0.1", self.port, shutdown_timeout=SHUTDOWN_S
        )

    async def aclose(self) -> None:
        """Stop serving; an event still waiting for its commit is answered 503 at once."""
        for ack in self._acks:
            ack.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        # Decided before routing's handler runs: a refused request reads no body, does nothing.
        refused = self.ui.refusal(request, self.port)
        return await handler(request) if refused is None else refused

    async def _health(self, request: web.Request) -> web.Response:
        # 503 while any part is failing, so a plain HTTP check sees it; the body says which.
        ports = self.ports
        failing = ports.health.failing()
        ok = not failing
        body = {
            "ok": ok,
            "nodeId": ports.node_id,
            "name": ports.name,
            "manager": ports.manager.status(),
            "failing": failing,
            "uptimeS": round(time.time() - ports.started_at, 1),
        }
        return json_answer(body, 200 if ok else 503)

    async def _jobs(self, request: web.Request) -> web.Response:
        query = request.query
        state = query.get("state")
        if state is not None and state not in _STATES:
            raise web.HTTPBadRequest(text=f"state is one of {', '.join(_STATES)}\n")
        try:
            limit = int(query.get("limit", "1000"))
        except ValueError:
            raise web.HTTPBadRequest(text="limit must be an integer\n") from None
        after = query.get("after")
        # The paged shape only when asked for: existing callers keep their plain list.
        paged = after is not None or query.get("page") == "1"
        try:
            await self.ports.writer.flush()  # what was handed in is what you see
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None
        try:
            jobs, more = await self.ports.store.jobs_page(
                state=state, node=query.get("node"), limit=limit, after=after,
                model=query.get("model"), requester=query.get("requester"),
            )  # fmt: skip
        except InvalidCursor:
            raise web.HTTPBadRequest(
                text="after is not a cursor this node gave out (a page's `next`)\n"
            ) from None
        return json_answer({"jobs": jobs, "next": more} if paged else jobs)

    async def _remove_job(self, request: web.Request) -> web.Response:
        # A removal as seed 002 has it (`workloads:remove {workloadId, originatedFrom}`), for
        # a job this node originated: only a node speaks for its own jobs.
        ports, wid = self.ports, request.match_info["id"]
        raw = await request.read()
        body = decoded(_event_decoder, raw, "bad removal") if raw.strip() else {}
        origin = body.get("originatedFrom", ports.node_id)
        try:
            removal = WorkloadRemoval(workloadId=wid, originatedFrom=str(origin))
            removal = msgspec.convert(msgspec.to_builtins(removal), WorkloadRemoval)
        except msgspec.ValidationError as exc:
            raise bad_request(exc, "bad removal") from None
        if removal.originatedFrom != ports.node_id:
            raise web.HTTPBadRequest(text=_not_ours(wid, [removal.originatedFrom]))
        try:
            await ports.writer.flush()
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None
        origins = await ports.store.origins_of(wid)
        already = ports.store.is_removed(ports.node_id, wid)
        if ports.node_id not in origins and not already:
            if origins:
                raise web.HTTPBadRequest(text=_not_ours(wid, origins))
            raise web.HTTPNotFound(text=f"no job {wid!r} in this node's Jobs list\n")
        if not already:
            try:
                await ports.remove_job(removal)
            except StoreUnavailable as exc:
                raise _unavailable(exc) from None
        return json_answer({"removed": wid, "originatedFrom": ports.node_id, "already": already})

    async def _manager(self, request: web.Request) -> web.Response:
        # `manager:status` (relay counters, per-peer broadcast) and the supervisor's own view;
        # 503 when the manager does not answer, with what the supervisor knows.
        supervisor = self.ports.manager
        body: dict[str, Any] = {
            "supervisor": {**supervisor.status(), "dropped": supervisor.dropped},
            "status": None,
        }
        try:
            body["status"] = await supervisor.request("manager:status")
        except (TimeoutError, BrokerError) as exc:
            body["error"] = str(exc)
            return json_answer(body, 503)
        return json_answer(body)

    async def _nodes(self, request: web.Request) -> web.Response:
        return json_answer(self.ports.members.nodes())

    async def _cluster_status(self, request: web.Request) -> web.Response:
        return json_answer(self.ports.members.status())

    async def _members(self, request: web.Request) -> web.Response:
        return json_answer(
            [
                {
                    "nodeId": m.node_id,
                    "name": m.name,
                    "pin": m.pin,
                    "added": m.added.isoformat() if m.added else None,
                    "removed": m.removed.isoformat() if m.removed else None,
                    "removedBy": remover(m.statement) if m.removed else None,
                }
                for m in self.ports.pins.members()
            ]
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        supervisor = self.ports.manager
        manager: dict[str, Any] = {}
        generation: int | None = supervisor.restarts  # which child answers (carried_counts)
        with contextlib.suppress(TimeoutError, BrokerError):
            manager = await supervisor.request("manager:status")
        if not manager or supervisor.restarts != generation:
            generation = None  # no answer, or maybe the previous child's: not taken
        self.collector.take(manager, generation, await self.ports.store.count_by_state())
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _explain(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        if not model:
            raise web.HTTPBadRequest(text="model=NAME is required\n")
        cluster, load = self.ports.view.current()
        ranking = rank(Request(model, origin=self.ports.node_id), cluster, load)
        return json_answer(
            {
                "model": model,
                "ranked": [{"nodeId": n, "score": s} for n, s in ranking.top(len(cluster))],
                "refused": [
                    {"nodeId": n, "reason": ranking.describe(r)} for n, r in ranking.refused()
                ],
            }
        )

    async def _ops(self, request: web.Request) -> web.Response:
        return json_answer(self.ports.operations.views())

    async def _start_op(self, request: web.Request) -> web.Response:
        body = await read_json(request, _event_decoder, "bad operation")
        try:
            timeout = body.get("timeoutS")
            op = self.ports.operations.start(
                str(body["kind"]),
                str(body["target"]),
                reason=str(body.get("reason", "")),
                timeout_s=float(timeout) if timeout is not None else None,
                force=bool(body.get("force", False)),
            )
        except (KeyError, TypeError, ValueError, OperationRefused) as exc:
            raise bad_request(exc, "bad operation") from None
        return json_answer(op.view())

    async def _event(self, request: web.Request) -> web.Response:
        body = await read_json(request, _event_decoder, "bad event")
        try:
            method = body["method"]
        except KeyError as exc:
            raise bad_request(exc, "bad event") from None
        params = decoded(_params_decoder, msgspec.json.encode(body.get("params")), "bad event")
        if not isinstance(method, str) or method not in LIFECYCLE_METHODS:
            raise web.HTTPBadRequest(text=f"method is one of {', '.join(LIFECYCLE_METHODS)}\n")
        mismatch = lifecycle_mismatch(method, params.workloadInfo)
        if mismatch:
            raise web.HTTPBadRequest(text=mismatch + "\n")
        record = params.workloadInfo
        if record.originatedFrom != self.ports.node_id:
            raise web.HTTPBadRequest(text=_ELSEWHERE.format(record.originatedFrom))
        self.ports.submit(method, record)
        # A 202 is durable: answered once the batch holding this record has committed to
        # this node's store (issue 11), within the writer's flush bound.
        key = (record.originatedFrom, record.runId, record.id)
        ack = asyncio.create_task(self.ports.writer.committed(key, record.seq))
        self._acks.add(ack)
        try:
            await ack
            # After the commit, so a store that refuses writes says why first; before the
            # 202, so a row of this run that the store loses later is one it can ask back.
            await self.ports.record_run(record.runId)
        except (StoreUnavailable, RunNotRecorded) as exc:
            raise _unavailable(exc) from None
        except asyncio.CancelledError:
            if not ack.cancelled() or _this_task_cancelled():
                raise
            # `aclose()` ended the wait: stopping is no reason to hold the answer.
            raise _unavailable(StoreUnavailable("the agent is stopping")) from None
        finally:
            self._acks.discard(ack)
        return web.Response(status=202)

    async def _remove(self, request: web.Request) -> web.Response:
        try:
            self.ports.remove_member(request.match_info["node_id"])
        except CertsError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        return json_answer({"removed": request.match_info["node_id"]})


def _this_task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _not_ours(wid: str, origins: list[str]) -> str:
    return (
        f"job {wid!r} was originated by {', '.join(origins)}, not this node: only the node "
        "that originated a job removes it (run `nvpair jobs remove` there)\n"
    )


def _unavailable(exc: StoreUnavailable | RunNotRecorded) -> web.HTTPServiceUnavailable:
    # The store (or the run book) is not taking writes: what was handed in is kept; ask again.
    return web.HTTPServiceUnavailable(text=f"{exc}\n", headers={"Retry-After": "1"})
