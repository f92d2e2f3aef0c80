"""The inference facade on 14323: OpenAI-compatible, any member takes any request.

This is seed 002's "proxy". At start it mints a `runId` (ULID); each request is a job with
`id` from a counter starting at 1 and `seq` from the facade's event counter. A request is
placed by the scheduler (NVML data, engines in the node records, pending work), then:
`workload:submitted` (queued, `originatedFrom` = this node), `workload:started` with
`scheduledOn`, and `workload:completed` or `workload:errored` (failed with a normalised
error, or cancelled when the client goes away). The request runs on the local engine or is
forwarded over the node API (mTLS, pinned) and streamed back.

Prompts and completions pass through here and over the node API only: they are never put in
an event, a log line, a metric or the plane.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web
from ulid import ULID

from scheduler import Cluster, Load, Refusal
from scheduler.replicas import ReplicaView
from workload_manager.sites import handler_bounds, start_site
from workload_manager.workload import Workload, WorkloadState

from .engines import Engines
from .errors import MemberUnreachable
from .job_errors import JobError, for_exception, for_status
from .lifetime import SHUTDOWN_S
from .openai_errors import openai_error, openai_errors
from .request_identity import identify, passed_back, stamp
from .request_identity import middleware as identified
from .routing import FAILOVER_STATUSES, Target, choose, served_models, sse_error
from .view import SchedulingView

__all__ = ["Facade", "facade_address", "openai_error"]

log = logging.getLogger(__name__)

MAX_BODY: Final = 8 * 1024 * 1024
_body_decoder: Final = msgspec.json.Decoder(dict[str, Any])
_HOP_HEADERS: Final = ("Content-Type", "Cache-Control")


@dataclass
class _Job:
    record: Workload


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


class Facade:
    """The aiohttp server and the job lifecycle of every request it takes."""

    def __init__(
        self,
        *,
        node_id: str,
        view: SchedulingView,
        engines: Engines,
        forward: Callable[[str, str, bytes, str], Any],
        submit: Callable[[str, Workload], None],
        host: str | None,
        port: int,
        api_keys: Mapping[str, str],
        queue_limit: int,
        replicas: Callable[[], list[ReplicaView]] = list,
        replica_url: Callable[[str], str | None] = lambda _: None,
    ) -> None:
        self.node_id = node_id
        self._view = view
        self._engines = engines
        self._forward = forward
        self._submit = submit
        self._replicas = replicas
        self._replica_url = replica_url
        self.pending: dict[str, int] = {}  # replica id -> our requests running there
        self.failovers = 0
        self.host = host
        self.port = port
        self.keys = {key: name for name, key in api_keys.items()}
        self.queue_limit = queue_limit
        self.run_id = str(ULID())
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self.in_flight: dict[str, int] = {}  # node id -> our requests running there
        self._handlers: dict[str, set[asyncio.Task[Any]]] = {}  # node id -> their handlers
        app = web.Application(client_max_size=MAX_BODY, middlewares=[identified, openai_errors()])
        app.on_response_prepare.append(stamp)  # X-Request-Id on every answer
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        # handler_cancellation: a client that disconnects cancels its handler (cancelled job)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_S,
            **handler_bounds(),
        )

    async def start(self) -> int:
        """Bind and serve; returns the port (OSError when it is in use)."""
        self.port = await start_site(self._runner, self.host, self.port)
        return self.port

    async def aclose(self) -> None:
        """Stop serving; requests in flight are cancelled (their jobs: cancelled)."""
        await self._runner.cleanup()

    # -- routes -----------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        if self._requester(request) is False:
            return openai_error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
        data = served_models(self._view.current()[0].models(), self._replicas())
        return web.Response(
            body=msgspec.json.encode({"object": "list", "data": data}),
            content_type="application/json",
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "/v1/chat/completions")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "/v1/completions")

    async def _infer(self, request: web.Request, path: str) -> web.StreamResponse:
        requester = self._requester(request)
        if requester is False:
            return openai_error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            # aiohttp's own 413 is plain text: OpenAI clients parse an error object.
            message = f"the body is over {MAX_BODY} bytes"
            return openai_error(413, message, "invalid_request_error", "request_too_large")
        try:
            body = _body_decoder.decode(raw)
            model = body["model"]
            if not isinstance(model, str) or not model:
                raise TypeError
        except (msgspec.DecodeError, KeyError, TypeError, RecursionError):
            # RecursionError: msgspec's answer to JSON nested past the recursion limit.
            return openai_error(400, "the body must be JSON with a model", "invalid_request_error")
        targets = choose(
            model,
            replicas=self._replicas(),
            pending=self.pending,
            nodes=self._nodes,
            origin=self.node_id,
            kind_on=self._view.engine_kind_for,
        )
        if isinstance(targets, Refusal):
            return _refused(targets, model)
        job = self._new_job(
            model, targets[0].kind, requester if isinstance(requester, str) else None
        )
        self._emit("workload:submitted", job)
        outcome: tuple[WorkloadState, JobError | None] = (WorkloadState.FAILED, JobError.INTERNAL)
        try:
            for attempt, target in enumerate(targets):
                if attempt:
                    self.failovers += 1
                    log.warning("failing over to %s", target.replica or target.node_id)
                self._advance(job, state=WorkloadState.RUNNING, scheduledOn=target.node_id,
                              startedAt=job.record.startedAt or _now_ms())  # fmt: skip
                self._emit("workload:started", job)  # each target in the job's history
                answer, outcome = await self._attempt(request, path, raw, target, model)
                if answer is not None:
                    return answer
            return openai_error(502, (outcome[1] or JobError.INTERNAL).value, "server_error")
        except asyncio.CancelledError:
            outcome = (WorkloadState.CANCELLED, JobError.CANCELLED)
            raise
        finally:
            # The error is a phrase of the closed vocabulary, never an engine's words.
            state, error = outcome
            self._advance(
                job,
                state=state,
                completedAt=_now_ms(),
                error=None if error is None else error.value,
            )
            self._emit(
                "workload:completed" if state is WorkloadState.COMPLETED else "workload:errored",
                job,
            )

    def _nodes(self) -> tuple[Cluster, Load]:
        cluster, load = self._view.current()
        for node_id, count in self.in_flight.items():
            load.add(node_id, count)
        return cluster, load

    async def _attempt(
        self, request: web.Request, path: str, raw: bytes, target: Target, model: str
    ) -> tuple[web.StreamResponse | None, tuple[WorkloadState, JobError | None]]:
        """One target; no answer (None) when it failed before any byte reached the client."""
        node, replica = target.node_id, target.replica
        self.in_flight[node] = self.in_flight.get(node, 0) + 1
        self.pending[replica] = self.pending.get(replica, 0) + 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.setdefault(node, set()).add(handler)
        try:
            return await self._run(request, path, raw, target, model)
        finally:
            self.in_flight[node] -= 1
            self.pending[replica] -= 1
            if handler is not None:
                self._handlers.get(node, set()).discard(handler)

    def cancel_on(self, target: str) -> int:
        """Cancel our requests running on `target` (a forced drain); their jobs: cancelled."""
        handlers = list(self._handlers.get(target, ()))
        for handler in handlers:
            handler.cancel()
        return len(handlers)

    # -- running ----------------------------------------------------------------------------

    async def run_forwarded(
        self, request: web.Request, path: str, raw: bytes
    ) -> web.StreamResponse:
        """Run a request another member placed here, on a local engine."""
        identify(request)  # the origin's X-Request-Id, on to the engine
        try:
            model = _body_decoder.decode(raw)["model"]
        except (msgspec.DecodeError, KeyError, TypeError, RecursionError):
            return openai_error(400, "the body must be JSON with a model", "invalid_request_error")
        replica = request.headers.get("X-Nvpair-Replica", "")
        url = self._replica_url(replica) if replica else self._engines.url_for(str(model))
        if url is None:
            return openai_error(503, "no engine here serves the model", "server_error")
        self.in_flight[self.node_id] = self.in_flight.get(self.node_id, 0) + 1
        try:
            async with self._engines.post(url, path, raw) as reply:
                answer, _ = await _relay(request, reply, origin=False)
                return answer
        except (aiohttp.ClientError, TimeoutError, OSError):
            return openai_error(502, "engine unreachable", "server_error")
        finally:
            self.in_flight[self.node_id] -= 1

    async def _run(
        self, request: web.Request, path: str, raw: bytes, target: Target, model: str
    ) -> tuple[web.StreamResponse | None, tuple[WorkloadState, JobError | None]]:
        local = target.node_id == self.node_id
        try:
            if local:
                url = self._replica_url(target.replica) if target.replica else None
                url = url or self._engines.url_for(model)
                if url is None:
                    return None, (WorkloadState.FAILED, JobError.NO_ENGINE)
                upstream = self._engines.post(url, path, raw)
            else:
                upstream = self._forward(target.node_id, path, raw, target.replica)
            async with upstream as reply:
                if reply.status in FAILOVER_STATUSES:
                    return None, (WorkloadState.FAILED, for_status(reply.status))
                return await _relay(request, reply, local=local)
        except (aiohttp.ClientError, TimeoutError, OSError, MemberUnreachable) as exc:
            error = for_exception(exc, local=local)
            log.warning(
                "request %s on %s failed: %s (%s)",
                path,
                target.replica or target.node_id,
                error.value,
                type(exc).__name__,
            )
            return None, (WorkloadState.FAILED, error)

    # -- jobs -------------------------------------------------------------------------------

    def _requester(self, request: web.Request) -> str | bool | None:
        if not self.keys:
            return None
        header = request.headers.get("Authorization", "")
        key = header[7:] if header.startswith("Bearer ") else ""
        return self.keys.get(key, False)

    def _new_job(self, model: str, engine: str, requester: str | None) -> _Job:
        record = Workload(
            id=str(next(self._ids)),
            model=model[:256],
            engine=engine,
            runId=self.run_id,
            state=WorkloadState.QUEUED,
            originatedFrom=self.node_id,
            createdAt=_now_ms(),
            startedAt=None,
            completedAt=None,
            error=None,
            requesterId=requester,
            seq=next(self._seq),
        )
        return _Job(record)

    def _advance(self, job: _Job, **changes: Any) -> None:
        job.record = msgspec.structs.replace(job.record, seq=next(self._seq), **changes)

    def _emit(self, method: str, job: _Job) -> None:
        self._submit(method, job.record)


def _refused(refusal: Refusal | None, model: str) -> web.Response:
    # The scheduler says why no member can take it; its status is what the client sees.
    status = refusal.status if refusal is not None else 503
    if status == 429:
        response = openai_error(429, "every member serving this model is busy", "rate_limit_error")
        response.headers["Retry-After"] = "1"
        return response
    if status == 404:
        return openai_error(
            404,
            f"The model `{model[:256]}` does not exist on any member",
            "invalid_request_error",
            "model_not_found",
        )
    reason = f" ({refusal.value})" if refusal is not None else ""
    return openai_error(503, f"no member can serve this model now{reason}", "server_error")


async def _relay(
    request: web.Request, reply: aiohttp.ClientResponse, *, local: bool = True, origin: bool = True
) -> tuple[web.StreamResponse, tuple[WorkloadState, JobError | None]]:
    """Pass the engine's answer through, streaming what streams. A stream that breaks is
    ended with an error event at the `origin` (the member facing the client); a member
    running a forwarded request breaks its own answer instead, so the origin sees it."""
    if reply.status >= 400:
        # The client gets the engine's answer as it is; the job, only the status class.
        body = await reply.read()
        outcome = (WorkloadState.FAILED, for_status(reply.status))
        return web.Response(
            status=reply.status,
            body=body,
            content_type=reply.content_type,
            headers=passed_back(reply.headers),
        ), outcome
    if reply.content_type == "text/event-stream":
        response = web.StreamResponse(
            status=reply.status,
            headers={
                **passed_back(reply.headers),
                **{h: reply.headers[h] for h in _HOP_HEADERS if h in reply.headers},
            },
        )
        await response.prepare(request)
        try:
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Bytes reached the client: no failover now. End the stream as OpenAI does.
            error = for_exception(exc, local=local)
            if not origin:
                if request.transport is not None:
                    request.transport.abort()
                return response, (WorkloadState.FAILED, error)
            await response.write(sse_error(error.value))
            await response.write_eof()
            return response, (WorkloadState.FAILED, error)
        await response.write_eof()
        return response, (WorkloadState.COMPLETED, None)
    body = await reply.read()
    return web.Response(
        status=reply.status,
        body=body,
        content_type=reply.content_type,
        headers=passed_back(reply.headers),
    ), (WorkloadState.COMPLETED, None)


def _now_ms() -> int:
    return int(time.time() * 1000)
