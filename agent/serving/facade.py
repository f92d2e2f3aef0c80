"""The inference facade on 14323: OpenAI-compatible, any member takes any request.

This is seed 002's "proxy": each request is a job (`facade_jobs`: one `runId` per start,
`id` counting from 1, a new `seq` per change). A request is placed by the scheduler (NVML
data, engines in the node records, pending work), then: `workload:submitted` (queued,
`originatedFrom` = this node), `workload:started` with `scheduledOn`, and
`workload:completed` or `workload:errored` (failed with a normalised error, or cancelled
when the client goes away), each change an event of the job's lifecycle table
(`job_lifecycle`). The request runs on the local engine or is forwarded over the node API
(mTLS, pinned) and streamed back. One that finds every target full waits, queued, in this
member's wait line (`wait_queue`) until one has room.

Prompts and completions pass through here and over the node API only: they are never put in
an event, a log line, a metric or the plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import aiohttp
from aiohttp import web

from agent.core.errors import MemberUnreachable
from agent.core.lifetime import SHUTDOWN_S
from agent.core.request_identity import identify, stamp_into, working_on
from agent.core.timings import Timings
from agent.engines.registry import Engines
from agent.serving.endpoint_forward import EndpointForward
from agent.serving.endpoint_routes import EndpointRoutes, endpoint_models, ready_in
from agent.serving.in_flight import InFlight
from agent.serving.job_errors import JobError, for_status
from agent.serving.jobs import Job, JobBook
from agent.serving.key_check import Access, KeyCheck, Requester
from agent.serving.lifecycle import Cancel, Ending, Fail, Failover, Outcome, Start
from agent.serving.openai_errors import json_answer, not_allowed, openai_error, refusal
from agent.serving.openai_routes import (
    ROUTES,
    BadBody,
    body_limit,
    form_model,
    json_request,
    model_object,
    model_of,
    read_body,
)
from agent.serving.relay import METER, for_exception, refused, relay
from agent.serving.routing import (
    FAILOVER_STATUSES,
    NO_ANCHOR,
    Anchor,
    AnchorSource,
    Policy,
    Target,
    choose,
    explain,
    lazy_anchor,
    served_models,
)
from agent.serving.usage import Meter, ask_for_usage
from agent.serving.view import SchedulingView
from agent.serving.wait_line import Ticket
from agent.serving.wait_queue import WAIT_QUEUE, WAIT_TIMEOUT_S, WaitQueue, gave_up
from netkit import tracing
from netkit.lean_http import Answer, LeanApp, LeanRequest
from netkit.lean_sites import LeanServer, start_lean
from scheduler import Cluster, Load, Refusal
from scheduler.prefix import anchor_of
from scheduler.replicas import ReplicaView
from workload_manager.workload import Workload

__all__ = ["Facade", "facade_address", "openai_error"]

log = logging.getLogger(__name__)

MAX_BODY: Final = max(route.limit for route in ROUTES.values())  # `_read` bounds each route
_MODELS: Final = "/v1/models"
_MODEL: Final = "/v1/models/"
MAX_TALLIES: Final = 4096  # (model, reason) pairs and round-robin turns kept
SESSION_HEADER: Final = "X-Session-Id"  # names a conversation, as `prompt_cache_key` does


def facade_address(
    facade_bind: str | None, bind: str | None, api_keys: bool
) -> tuple[str | None, str]:
    """Where the facade listens, and why: `facade_bind`, else NVPAIR_BIND (`bind`), else every
    interface when API keys are configured, else loopback only -- without keys anyone who
    reaches the port could spend the cluster's GPUs, so it is opened only on purpose."""
    if facade_bind:
        return facade_bind, "facade_bind"
    if bind:
        return bind, "NVPAIR_BIND"
    if api_keys:
        return None, "every interface: API keys are configured"
    return "127.0.0.1", "loopback only: no API keys; set api_keys or facade_bind to serve others"


COLD_WAIT_BUCKETS: Final = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # seconds
# What a model of an elastic deployment with no replica ready is refused while one starts.
_COLD: Final = (Refusal.MODEL_NOT_SERVED, Refusal.REPLICA_NOT_READY)
# Refusals a member coming back can lift: asked again of a fresh view (`SchedulingView`).
_RECHECKED: Final = (Refusal.MODEL_NOT_SERVED, Refusal.UNREACHABLE, Refusal.ENGINES_DOWN)


class Facade:
    """The aiohttp server and the job lifecycle of every request it takes."""

    def __init__(
        self,
        *,
        node_id: str,
        view: SchedulingView,
        engines: Engines,
        forward: Callable[[str, str, bytes, str, str], Any],
        submit: Callable[[str, Workload], None],
        host: str | None,
        port: int,
        api_keys: Mapping[str, str],
        queue_limit: int,
        replicas: Callable[[], list[ReplicaView]] = list,
        replica_url: Callable[[str], str | None] = lambda _: None,
        key_check: KeyCheck | None = None,
        wait: tuple[int, float] = (WAIT_QUEUE, WAIT_TIMEOUT_S),  # wait_queue, wait_timeout_s
        waits: WaitQueue[Target] | None = None,  # made by the caller (else from `wait`)
        elastic: Callable[[], Mapping[str, float]] = dict,
        on_usage: Callable[[Workload, Meter], None] = lambda _job, _meter: None,
        policy: Policy = "prefix",
    ) -> None:
        self.anchor_key = b""  # scheduler.prefix.anchor_key of the cluster's CA (the daemon's)
        self.policy: Policy = policy  # how a deployment's replica is chosen (`routing`)
        self.decisions: dict[tuple[str, str], int] = {}  # (model, reason) -> requests sent
        self._turns: dict[str, int] = {}  # model -> requests placed (round-robin)
        self._on_usage = on_usage  # each finished job's usage and times (`usage_book`)
        self.node_id = node_id
        self._view = view
        self._engines = engines
        self._forward = forward
        self._replicas = replicas
        self._replica_url = replica_url
        self.pending = InFlight()  # replica id -> our requests running there (and lately)
        self.failovers = 0
        self.host = host
        self.port = port
        self.keys = key_check or KeyCheck(
            api_keys
        )  # who may send requests (agent.serving.key_check)
        self.queue_limit = queue_limit
        self.waits: WaitQueue[Target] = waits or WaitQueue(length=wait[0], timeout_s=wait[1])
        # The deployments that scale on load (issue 30), each with its cold-start timeout
        # (0: the line's own): listed in /v1/models at zero, and with no replica ready -- at
        # zero, or starting -- their requests wait for one, that long at most.
        self._elastic = elastic
        self.cold_waits = Timings(COLD_WAIT_BUCKETS)  # requests that waited for a cold start
        self.jobs = JobBook(node_id, submit)
        # Endpoints' public names (agent.serving.endpoint_routes): the plane's table, empty
        # without one.
        self.endpoints = EndpointRoutes(ready_here=lambda name: ready_in(self._replicas(), name))
        self._endpoint = EndpointForward(self.endpoints)
        self.in_flight: dict[str, int] = {}  # node id -> our requests running there
        self._handlers: dict[str, set[asyncio.Task[Any]]] = {}  # node id -> their handlers
        # Served by netkit.lean_http, not aiohttp's application stack (issue 33): a client
        # that disconnects cancels its handler (a cancelled job), every answer says its
        # X-Request-Id, and the server's own refusals are OpenAI-shaped like the rest.
        self._app = LeanApp(
            handler=self._dispatch,
            body_limit=body_limit,
            refusal=refusal,
            on_answer=stamp_into,
        )
        self._server: LeanServer | None = None  # while serving

    async def start(self) -> int:
        """Bind and serve; returns the port (OSError when it is in use)."""
        self._server = await start_lean(self._app, self.host, self.port)
        self.port = self._server.port
        return self.port

    async def aclose(self) -> None:
        """Stop serving: requests in flight get `SHUTDOWN_S` to end, then are cancelled
        (their jobs: cancelled)."""
        if self._server is not None:
            await self._server.aclose(grace_s=SHUTDOWN_S)
            self._server = None
        await self._endpoint.aclose()

    async def _dispatch(self, request: LeanRequest) -> Answer:
        """The route a request's method and path name, or the OpenAI-shaped 404 or 405."""
        identify(request)
        path, method = request.path, request.method
        if path in ROUTES:  # agent.serving.openai_routes: every route a job, as chat is
            if method != "POST":
                return not_allowed(method, "POST")
            if tracing.on():
                return await self._traced(request, path)
            return await self._infer(request, path)
        if path == _MODELS or (path.startswith(_MODEL) and len(path) > len(_MODEL)):
            if method not in ("GET", "HEAD"):
                return not_allowed(method, "GET, HEAD")
            if path == _MODELS:
                return self._models(request)
            return self._model(request, path[len(_MODEL) :])
        message = f"no route {method[:16]} {path[:200]}"
        return openai_error(404, message, "invalid_request_error", "unknown_url")

    # -- routes -----------------------------------------------------------------------------

    def _models(self, request: LeanRequest) -> web.Response:
        requester = self._requester(request)
        if requester is Access.REFUSED:
            return openai_error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
        return json_answer({"object": "list", "data": self._served(requester, request.host)})

    def _model(self, request: LeanRequest, model: str) -> web.Response:
        requester = self._requester(request)
        if requester is Access.REFUSED:
            return openai_error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
        entry = model_object(self._served(requester, request.host), model)
        if entry is None:
            message = f"The model `{model[:256]}` does not exist"
            return openai_error(404, message, "invalid_request_error", "model_not_found")
        return json_answer(entry)

    def _served(self, requester: Requester, host: str) -> list[dict[str, object]]:
        # What the cluster serves, narrowed to the models the caller's key may use.
        served = served_models(
            self._view.current()[0].models(), self._replicas(), elastic=self._elastic()
        )
        served += endpoint_models(self.endpoints.models(host), served)
        return [m for m in served if self.keys.may_use(requester, str(m["id"]))]

    async def _traced(self, request: LeanRequest, path: str) -> Answer:
        """`_infer` in a span of the request's trace (the client's, when it sent one)."""
        attributes = {
            "http.request.method": "POST",
            "http.route": path,
            "nvpair.node.id": self.node_id,
        }
        parent = tracing.extracted(request.headers)
        with tracing.span(
            f"POST {path}", kind="server", parent=parent, attributes=attributes
        ) as span:
            answer = await self._infer(request, path)
            if span is not None:
                span.set_attribute("http.response.status_code", answer.status)
            return answer

    async def _infer(self, request: LeanRequest, path: str) -> Answer:
        requester = self._requester(request)
        if requester is Access.REFUSED:
            return openai_error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
        read = await self._read(request, path)
        if isinstance(read, web.Response):
            return read
        raw, model, anchor = read
        if (denied := await self.keys.admit(requester, model)) is not None:
            return denied  # a model the key may not use, or over the key's limits: no job
        routed = await self._endpoint.route(request, path, raw, model)  # an endpoint's name?
        if not isinstance(routed, tuple):
            return routed  # served by another cluster, or refused
        raw, model = routed
        entered = self.waits.enter(
            model, lambda: self._place(model, anchor), lambda: self._cold_timeout(model)
        )
        if isinstance(entered, Refusal):
            return refused(entered, model)
        cold = isinstance(entered, Ticket) and self._cold(model)
        entered_at = time.monotonic()
        kind = entered[0].kind if isinstance(entered, list) else "unknown"  # unknown: waiting
        raw, strip = ask_for_usage(raw, path)  # streamed: ask the engine for usage
        meter = request[METER] = Meter(strip=strip)
        jobs = self.jobs
        job = jobs.new(model, kind, requester if isinstance(requester, str) else None)
        jobs.emit(job)  # workload:submitted
        working_on(job.record.runId, job.record.id)  # its log lines say so
        if tracing.on():
            tracing.note(_job_attributes(job.record))
        ending: Ending = Fail(error=JobError.INTERNAL)  # unless something says otherwise
        try:
            targets = await self._wait(entered, model, anchor, cold)
            if isinstance(targets, Refusal):  # waited too long, or the model went
                waited = entered.timeout_s if isinstance(entered, Ticket) else 0.0
                ended, ending = gave_up(targets, model, waited)
                return ended
            if cold:
                self.cold_waits.observe(time.monotonic() - entered_at)
            if tracing.on():
                _trace_choice(self.policy, targets)
            log.debug(
                "%s placed on %s (%s)", model[:256], targets[0].replica or targets[0].node_id,
                targets[0].reason,
            )  # fmt: skip
            for attempt, target in enumerate(targets):
                self._decided(model, "failover" if attempt else target.reason)
                if attempt:
                    self.failovers += 1
                    log.warning("failing over to %s", target.replica or target.node_id)
                    jobs.advance(job, Failover(scheduled_on=target.node_id))
                else:
                    jobs.advance(job, Start(scheduled_on=target.node_id, engine=target.kind))
                jobs.emit(job)  # workload:started: each target in the job's history
                answer, ending = await self._attempt(request, path, raw, target, model)
                if answer is not None:
                    return answer
            failed = ending.error if isinstance(ending, Fail) else JobError.INTERNAL
            return openai_error(502, failed.value, "server_error")
        except asyncio.CancelledError:
            ending = Cancel()
            raise
        finally:
            # The error is a phrase of the closed vocabulary, never an engine's words.
            jobs.advance(job, ending)
            meter.finish()
            # Told once the answer is written (the server writes it as this returns), before
            # anything the client sends next is read: off the request's own time.
            asyncio.get_running_loop().call_soon(self._ended, job, meter, requester)
            if tracing.on():  # the error is our phrase, as in the job
                tracing.note(
                    {"nvpair.job.state": job.record.state.value}, error=job.record.error or None
                )

    def _ended(self, job: Job, meter: Meter, requester: Requester) -> None:
        self._on_usage(job.record, meter)  # before the record: the plane gets both
        if meter.usage is not None:  # a key's tokens per minute count what engines said
            used = meter.usage.prompt + meter.usage.completion
            self.keys.record_tokens(requester if isinstance(requester, str) else None, used)
        self.jobs.emit(job)  # workload:completed, or workload:errored

    async def _read(
        self, request: LeanRequest, path: str
    ) -> tuple[bytes, str, AnchorSource] | web.Response:
        """The body, the model it names (read as the route says) and what it is routed by;
        or the error the client gets -- OpenAI-shaped: aiohttp's own 413 is plain text."""
        route = ROUTES[path]
        raw = await read_body(request, route.limit)
        if raw is None:
            message = f"the body is over {route.limit} bytes"
            return openai_error(413, message, "invalid_request_error", "request_too_large")
        try:
            if route.form:
                return raw, form_model(request.headers.get("Content-Type", ""), raw), NO_ANCHOR
            model, body = json_request(raw)  # decoded once: the model and the anchor
        except BadBody as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        if not route.prompted or self.policy != "prefix":
            return raw, model, NO_ANCHOR
        session = request.headers.get(SESSION_HEADER, "")
        return raw, model, lazy_anchor(body, self.anchor_key, session)

    async def _wait(
        self, entered: list[Target] | Ticket, model: str, anchor: AnchorSource, cold: bool
    ) -> list[Target] | Refusal:
        """The targets once the request's turn comes (at once when it did not wait); a span
        of the trace for the time it waited."""
        place = lambda: self._place(model, anchor)  # noqa: E731
        if not (isinstance(entered, Ticket) and tracing.on()):
            return await self.waits.wait(entered, place)
        with tracing.span("nvpair.wait", attributes={"nvpair.wait.cold_start": cold}) as span:
            targets = await self.waits.wait(entered, place)
            if span is not None and isinstance(targets, Refusal):
                span.set_attribute("nvpair.wait.refusal", targets.value)
            return targets

    def _place(self, model: str, anchor: AnchorSource = NO_ANCHOR) -> list[Target] | Refusal:
        """Where the request runs (best first, for one failover), or why nowhere."""
        turn = 0
        if self.policy == "round-robin":
            if len(self._turns) >= MAX_TALLIES and model not in self._turns:
                self._turns.clear()
            turn = self._turns[model] = self._turns.get(model, -1) + 1

        def placed_now() -> list[Target] | Refusal:
            return choose(
                model,
                replicas=self._replicas(),
                pending=self.pending,
                nodes=self._nodes,
                origin=self.node_id,
                kind_on=self._view.engine_kind_for,
                pending_then=self.pending.then,
                anchor=anchor,
                policy=self.policy,
                turn=turn,
            )

        placed = placed_now()
        if placed in _RECHECKED and self._view.expire():
            placed = placed_now()  # not on a view compiled before a member came back
        if placed in _COLD and model in self._elastic():
            return Refusal.QUEUE_FULL  # a cold start: wait in line while a replica starts
        return placed

    def _cold_timeout(self, model: str) -> float | None:
        """How long a request joining `model`'s line may wait: its deployment's cold-start
        timeout when that is longer than the line's and no replica is ready; None, the
        line's own. Asked only of a request that joins the line, never on the way past it."""
        if not self._cold(model):
            return None
        return max(self._elastic().get(model, 0.0), self.waits.line.timeout_s)

    def _cold(self, model: str) -> bool:
        """Whether `model` is an elastic deployment with no replica ready anywhere now."""
        if model not in self._elastic():
            return False
        return not any(r.model == model and r.state == "ready" for r in self._replicas())

    def explain(self, model: str, body: Mapping[str, Any], session: str = "") -> dict[str, Any]:
        """How a request `body` for `model` would be routed now (`routing.explain`)."""
        digest, named = anchor_of(body, self.anchor_key, session=session)
        return explain(
            model,
            replicas=self._replicas(),
            pending=self.pending,
            anchor=Anchor(digest, named),
            policy=self.policy,
            pending_then=self.pending.then,
        )

    def _decided(self, model: str, reason: str) -> None:
        # Routing decisions by reason, for `nvpair_routing_decisions_total` (labels bounded
        # again there: a model the cluster no longer knows counts as `other`).
        tally = (model, reason)
        if tally not in self.decisions and len(self.decisions) >= MAX_TALLIES:
            return
        self.decisions[tally] = self.decisions.get(tally, 0) + 1

    def _nodes(self) -> tuple[Cluster, Load]:
        cluster, load = self._view.current()
        for node_id, count in self.in_flight.items():
            load.add(node_id, count)
        return cluster, load

    async def _attempt(
        self, request: LeanRequest, path: str, raw: bytes, target: Target, model: str
    ) -> tuple[Answer | None, Outcome]:
        """One target; no answer (None) when it failed before any byte reached the client."""
        node, replica = target.node_id, target.replica
        self.in_flight[node] = self.in_flight.get(node, 0) + 1
        if replica:  # a deployment's replica (a node's own engines are counted per node)
            self.pending.add(replica, 1)
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.setdefault(node, set()).add(handler)
        try:
            return await self._run(request, path, raw, target, model)
        finally:
            self.in_flight[node] -= 1
            if replica:
                self.pending.add(replica, -1)
            if handler is not None:
                self._handlers.get(node, set()).discard(handler)
            self.waits.poke()  # a slot freed: the heads of the wait lines look again

    def cancel_on(self, target: str) -> int:
        """Cancel our requests running on `target` (a forced drain); their jobs: cancelled."""
        handlers = list(self._handlers.get(target, ()))
        for handler in handlers:
            handler.cancel()
        return len(handlers)

    # -- running ----------------------------------------------------------------------------

    async def run_forwarded(
        self, request: web.Request | LeanRequest, path: str, raw: bytes
    ) -> Answer:
        """Run a request another member placed here, on a local engine."""
        identify(request)  # the origin's X-Request-Id, on to the engine
        sent = request.headers.get("Content-Type", "")
        try:
            model = model_of(ROUTES[path], sent, raw)
        except BadBody as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        replica = request.headers.get("X-Nvpair-Replica", "")
        url = self._replica_url(replica) if replica else self._engines.url_for(str(model))
        if url is None:
            return openai_error(503, "no engine here serves the model", "server_error")
        self.in_flight[self.node_id] = self.in_flight.get(self.node_id, 0) + 1
        try:
            if not tracing.on():
                return await self._run_here(request, url, path, raw, sent)
            # The span of the hop (the origin's context) and, in it, the engine's call.
            parent = tracing.extracted(request.headers)
            attributes = {"nvpair.node.id": self.node_id, "gen_ai.request.model": str(model)}
            with tracing.span(
                "nvpair.forwarded", kind="server", parent=parent, attributes=attributes
            ):
                call = {"nvpair.replica": replica} if replica else {}
                with tracing.span("nvpair.engine", kind="client", attributes=call) as span:
                    answer = await self._run_here(request, url, path, raw, sent)
                    if span is not None:
                        span.set_attribute("http.response.status_code", answer.status)
                    return answer
        finally:
            self.in_flight[self.node_id] -= 1
            self.waits.poke()

    async def _run_here(
        self, request: web.Request | LeanRequest, url: str, path: str, raw: bytes, sent: str
    ) -> Answer:
        try:
            async with self._engines.post(url, path, raw, sent) as reply:
                answer, _ = await relay(request, reply, origin=False)
                return answer
        except (aiohttp.ClientError, TimeoutError, OSError):
            return openai_error(502, "engine unreachable", "server_error")

    async def _run(
        self, request: LeanRequest, path: str, raw: bytes, target: Target, model: str
    ) -> tuple[Answer | None, Outcome]:
        if not tracing.on():
            return await self._run_on(request, path, raw, target, model)
        # A span the call is made in: its context goes to the engine or the member.
        name = "nvpair.engine" if target.node_id == self.node_id else "nvpair.forward"
        with tracing.span(name, kind="client", attributes=_target_attributes(target)) as span:
            answer, outcome = await self._run_on(request, path, raw, target, model)
            if isinstance(outcome, Fail):
                tracing.failed(span, outcome.error.value)
            elif span is not None and answer is not None:
                span.set_attribute("http.response.status_code", answer.status)
            return answer, outcome

    async def _run_on(
        self, request: LeanRequest, path: str, raw: bytes, target: Target, model: str
    ) -> tuple[Answer | None, Outcome]:
        local = target.node_id == self.node_id
        sent = ROUTES[path].engine_content_type(request.headers.get("Content-Type", ""))
        try:
            if local:
                url = self._replica_url(target.replica) if target.replica else None
                url = url or self._engines.url_for(model)
                if url is None:
                    return None, Fail(error=JobError.NO_ENGINE)
                upstream = self._engines.post(url, path, raw, sent)
            else:
                upstream = self._forward(target.node_id, path, raw, target.replica, sent)
            async with upstream as reply:
                if reply.status in FAILOVER_STATUSES:
                    return None, Fail(error=for_status(reply.status))
                return await relay(request, reply, local=local)
        except (aiohttp.ClientError, TimeoutError, OSError, MemberUnreachable) as exc:
            error = for_exception(exc, local=local)
            log.warning(
                "request %s on %s failed: %s (%s)",
                path,
                target.replica or target.node_id,
                error.value,
                type(exc).__name__,
            )
            return None, Fail(error=error)

    # -- keys -------------------------------------------------------------------------------

    def _requester(self, request: LeanRequest | web.Request) -> Requester:
        return self.keys.requester(request.headers.get("Authorization", ""))


def _job_attributes(job: Workload) -> dict[str, str]:
    """What a request's span says of its job: never its prompt or answer."""
    attributes = {
        "gen_ai.request.model": job.model,
        "nvpair.job.id": job.id,
        "nvpair.job.run_id": job.runId,
        "nvpair.job.origin": job.originatedFrom,
    }
    if job.requesterId:
        attributes["nvpair.key"] = job.requesterId  # the key's name, never the key
    return attributes


def _target_attributes(target: Target) -> dict[str, str | float]:
    attributes: dict[str, str | float] = {"nvpair.target.node_id": target.node_id}
    if target.replica:
        attributes["nvpair.target.replica"] = target.replica
    attributes["nvpair.target.engine"] = target.kind
    return attributes


def _trace_choice(policy: str, targets: list[Target]) -> None:
    """A span of the replica choice: the policy, the reason, the chosen target and its
    score, and the next best (a failover's target)."""
    first = targets[0]
    attributes: dict[str, str | float] = {
        "nvpair.route.policy": policy,
        "nvpair.route.reason": first.reason,
        "nvpair.route.score": first.score,
        **_target_attributes(first),
    }
    if len(targets) > 1:
        attributes["nvpair.route.then.node_id"] = targets[1].node_id
        attributes["nvpair.route.then.replica"] = targets[1].replica
        attributes["nvpair.route.then.score"] = targets[1].score
    with tracing.span("nvpair.route", attributes=attributes):
        pass
