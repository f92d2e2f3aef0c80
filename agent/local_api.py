"""The local API on 127.0.0.1:14322 (loopback only): what the CLI and the web page read.

- `GET /healthz` -- the node, its workload manager child, uptime.
- `GET /v1/jobs?state=&node=&limit=` -- the Jobs list, newest first.
- `GET /v1/nodes` -- every member's record with `reachable`.
- `GET /v1/members` -- the pins: node id, name, pin, added, removed.
- `GET /metrics` -- Prometheus text format (prometheus-client).
- `POST /v1/jobs/events` -- enter a local lifecycle event (`{method, params: {workloadInfo}}`);
  the facade does this in-process, this route is for operators and tests.
- `POST /v1/members/{node_id}/remove` -- `nvpair cluster remove`.

Only the loopback interface is bound: anything that can reach it can already read the
node's files.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Final

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from certs import CertsError
from scheduler import Request, rank
from workload_manager.workload import LIFECYCLE_METHODS, LifecycleParams, lifecycle_mismatch

if TYPE_CHECKING:
    from .daemon import Agent

__all__ = ["LocalApi"]

_STATES: Final = ("queued", "running", "completed", "failed", "cancelled")
_event_decoder: Final = msgspec.json.Decoder(dict[str, Any])
_params_decoder: Final = msgspec.json.Decoder(LifecycleParams)


class LocalApi:
    """aiohttp server bound to 127.0.0.1."""

    def __init__(self, agent: Agent, *, port: int) -> None:
        self.agent = agent
        self.port = port
        self.registry = CollectorRegistry()
        self.collector = _Metrics(agent)
        self.registry.register(self.collector)
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/v1/jobs", self._jobs)
        app.router.add_get("/v1/nodes", self._nodes)
        app.router.add_get("/v1/members", self._members)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/explain", self._explain)
        app.router.add_get("/v1/ops", self._ops)
        app.router.add_post("/v1/ops", self._start_op)
        app.router.add_post("/v1/jobs/events", self._event)
        app.router.add_post("/v1/members/{node_id}/remove", self._remove)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = int(self._runner.addresses[0][1])

    async def aclose(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        agent = self.agent
        return _json(
            {
                "ok": agent.supervisor.state == "running",
                "nodeId": agent.node_id,
                "name": agent.config.name,
                "manager": agent.supervisor.status(),
                "uptimeS": round(time.time() - agent.started_at, 1),
            }
        )

    async def _jobs(self, request: web.Request) -> web.Response:
        query = request.query
        state = query.get("state")
        if state is not None and state not in _STATES:
            raise web.HTTPBadRequest(text=f"state is one of {', '.join(_STATES)}\n")
        try:
            limit = int(query.get("limit", "1000"))
        except ValueError:
            raise web.HTTPBadRequest(text="limit must be an integer\n") from None
        await self.agent.writer.flush()  # what was handed in is what you see
        jobs = await self.agent.store.jobs(state=state, node=query.get("node"), limit=limit)
        return _json(jobs)

    async def _nodes(self, request: web.Request) -> web.Response:
        return _json(self.agent.nodes())

    async def _members(self, request: web.Request) -> web.Response:
        return _json(
            [
                {
                    "nodeId": m.node_id,
                    "name": m.name,
                    "pin": m.pin,
                    "added": m.added.isoformat() if m.added else None,
                    "removed": m.removed.isoformat() if m.removed else None,
                }
                for m in self.agent.cluster.pins.members()
            ]
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        manager: dict[str, Any] = {}
        with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
            manager = await self.agent.supervisor.request("manager:status")
        self.collector.snapshot = (manager, await self.agent.store.count_by_state())
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _explain(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        if not model:
            raise web.HTTPBadRequest(text="model=NAME is required\n")
        cluster, load = self.agent.scheduling_view()
        ranking = rank(
            Request(model, origin=self.agent.node_id),
            cluster,
            load,
        )
        return _json(
            {
                "model": model,
                "ranked": [{"nodeId": n, "score": s} for n, s in ranking.top(len(cluster))],
                "refused": [{"nodeId": n, "reason": r} for n, r in ranking.refused()],
            }
        )

    async def _ops(self, request: web.Request) -> web.Response:
        return _json([op.view() for op in reversed(self.agent.operations.values())])

    async def _start_op(self, request: web.Request) -> web.Response:
        try:
            body = _event_decoder.decode(await request.read())
            timeout = body.get("timeoutS")
            op = self.agent.start_operation(
                str(body["kind"]),
                str(body["target"]),
                reason=str(body.get("reason", "")),
                timeout_s=float(timeout) if timeout is not None else None,
                force=bool(body.get("force", False)),
            )
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            raise web.HTTPBadRequest(text=f"bad operation: {exc}\n") from None
        return _json(op.view())

    async def _event(self, request: web.Request) -> web.Response:
        try:
            body = _event_decoder.decode(await request.read())
            method = body["method"]
            params = _params_decoder.decode(msgspec.json.encode(body.get("params")))
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise web.HTTPBadRequest(text=f"bad event: {exc}\n") from None
        if method not in LIFECYCLE_METHODS:
            raise web.HTTPBadRequest(text=f"method is one of {', '.join(LIFECYCLE_METHODS)}\n")
        mismatch = lifecycle_mismatch(method, params.workloadInfo)
        if mismatch:
            raise web.HTTPBadRequest(text=mismatch + "\n")
        self.agent.submit(method, params.workloadInfo)
        return web.Response(status=202)

    async def _remove(self, request: web.Request) -> web.Response:
        try:
            self.agent.remove_member(request.match_info["node_id"])
        except CertsError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        return _json({"removed": request.match_info["node_id"]})


def _json(value: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json")


class _Metrics(Collector):
    """Gauges read from the agent at scrape time; never a prompt, only counts."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        # The manager's status and the job counts, read (async) just before each scrape.
        self.snapshot: tuple[dict[str, Any], dict[str, int]] = ({}, {})

    def collect(self) -> Any:
        manager, counts = self.snapshot
        jobs = GaugeMetricFamily("nvpair_jobs", "Jobs in the Jobs list by state", labels=["state"])
        for state in _STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        relay = manager.get("counters", {})
        for name, help_text in (
            ("received_remote", "Workload events received from peers"),
            ("received_local", "Workload events received from the broker"),
            ("accepted", "Workload events that were new"),
            ("duplicates", "Duplicate workload events dropped"),
            ("stale", "Stale workload events dropped"),
        ):
            gauge = GaugeMetricFamily(f"nvpair_relay_{name}", help_text)
            gauge.add_metric([], relay.get(name, 0))
            yield gauge
        retries = GaugeMetricFamily(
            "nvpair_broadcast_retried", "Broadcast batches retried", labels=["peer"]
        )
        depth = GaugeMetricFamily(
            "nvpair_broadcast_queue_depth", "Events waiting for a peer", labels=["peer"]
        )
        for peer in manager.get("broadcast", []):
            retries.add_metric([peer["nodeId"]], peer.get("retried", 0))
            depth.add_metric([peer["nodeId"]], peer.get("queued", 0))
        yield retries
        yield depth
        memory_total = GaugeMetricFamily(
            "nvpair_gpu_memory_total_bytes", "GPU memory", labels=["device", "class"]
        )
        memory_used = GaugeMetricFamily(
            "nvpair_gpu_memory_used_bytes", "GPU memory in use", labels=["device", "class"]
        )
        utilization = GaugeMetricFamily(
            "nvpair_gpu_utilization_percent", "GPU utilisation", labels=["device", "class"]
        )
        for device in self.agent.gpus.devices:
            labels = [device.id, device.deviceClass]
            memory_total.add_metric(labels, device.memoryTotal)
            memory_used.add_metric(labels, device.memoryUsed)
            utilization.add_metric(labels, device.utilization or 0)
        yield memory_total
        yield memory_used
        yield utilization
        restarts = GaugeMetricFamily("nvpair_manager_restarts", "Workload manager restarts")
        restarts.add_metric([], self.agent.supervisor.restarts)
        yield restarts
