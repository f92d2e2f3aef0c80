"""The plane's HTTP API (aiohttp over `PlaneStore`).

Admin calls carry the admin token; cluster calls carry the cluster's `hgro1.` enrolment
token. A cluster token reads and writes its own cluster only.

    GET  /healthz                       anyone  -> {ok} (503 while the database is not ready)
    POST /v1/clusters {name}            admin   -> {id, name, token} (the token is shown once)
    POST /v1/clusters/{id}/revoke       admin
    GET  /v1/clusters                   admin
    GET  /v1/clusters/{id}              admin, or that cluster
    POST /v1/sync                       cluster -> one node's SyncBatch, signed by that node
    GET  /v1/fleet/summary?window=3600  admin (a cluster sees itself)
    GET  /v1/jobs?cluster=&state=&model=&after=&limit=   admin, or that cluster

Statuses say whose fault: 400 bad input (nothing written), 401 a wrong or revoked token,
403 the token may not do that, or a sync that is not the named node's own (unsigned, signed
by another node or another cluster CA), 404, 409 a conflict (a cluster name enrolled twice),
413, 415; 503 with `Retry-After` when the database is down or not ready yet. Every error body is
`{"error": "..."}`.
"""

from __future__ import annotations

import datetime
import logging
import ssl
from collections.abc import Callable
from typing import Any, Final

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from netkit.sites import start_runner
from plane.core.errors import DatabaseUnavailable, PlaneError
from plane.core.ids import is_id
from plane.core.roles import Role
from plane.core.wire import (
    JOB_STATES,
    EnrolRequest,
    SyncBatch,
    decode_cursor,
    encode_cursor,
    without_nul,
)
from plane.db.connection import first_line
from plane.db.store import PlaneStore
from plane.fleet.node_signing import SyncVerifier, cluster_ca_of_pem, read_signature
from plane.http.answers import JsonBody, error_answer, json_answer, refusal
from plane.http.context import ApiContext
from plane.http.mounts import MOUNTS

__all__ = ["MAX_BODY", "MAX_WINDOW_S", "PlaneServer"]

log = logging.getLogger(__name__)

MAX_BODY: Final = 32 * 1024 * 1024
MAX_WINDOW_S: Final = 366 * 86400
_MAX_MODEL: Final = 256
_SYNC_BATCH: Final = JsonBody(SyncBatch, malformed=lambda why: f"malformed sync batch: {why}")
_ENROL: Final = JsonBody(EnrolRequest, malformed='the body is {"name": "1 to 128 characters"}')


def _unavailable(message: str, retry_after_s: int) -> web.Response:
    response = error_answer(503, message)
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def _always_ready() -> str | None:
    return None


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class PlaneServer:
    """The HTTP API over a store; `start()` binds, `aclose()` stops.

    `not_ready` says why the plane cannot serve yet (its database not reachable at start,
    say), or None once it can; until then every call but `/healthz` is a 503.
    """

    def __init__(
        self,
        store: PlaneStore,
        *,
        host: str | None,
        port: int,
        not_ready: Callable[[], str | None] = _always_ready,
        ssl_context: ssl.SSLContext | None = None,
        now: Callable[[], datetime.datetime] = _utc_now,
    ) -> None:
        self.store = store
        self.context = ApiContext(store)  # what the route groups get: the pool, who calls
        self.verifier = SyncVerifier()  # a sync is written only when its node signed it
        self._now = now
        self.host = host
        self.port = port
        self.ssl_context = ssl_context  # HTTPS with it (`nvpair plane serve --cert --key`)
        self.not_ready = not_ready
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._faults])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_post("/v1/clusters", self._enrol)
        app.router.add_post("/v1/clusters/{id}/revoke", self._revoke)
        app.router.add_get("/v1/clusters", self._clusters)
        app.router.add_get("/v1/clusters/{id}", self._cluster)
        app.router.add_post("/v1/sync", self._sync)
        app.router.add_get("/v1/fleet/summary", self._summary)
        app.router.add_get("/v1/jobs", self._jobs)
        for mount in MOUNTS:  # the demand side's routes (plane/http/mounts.py)
            mount(app, self.context)
        self._app = app
        self._runner: web.AppRunner | None = None  # while serving

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        self._runner, self.port = await start_runner(
            self._app, self.host, self.port, ssl_context=self.ssl_context
        )
        return self.port

    async def aclose(self) -> None:
        """Stop serving and close connections."""
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The one place a `PlaneError` becomes its status: the caller's faults are 4xx, a
        database that is down is 503 with `Retry-After`."""
        if request.path != "/healthz" and (why := self.not_ready()) is not None:
            return _unavailable(why, 1)
        try:
            return await handler(request)
        except DatabaseUnavailable as exc:
            cause = first_line(exc.__cause__) if exc.__cause__ is not None else ""
            log.warning("%s %s: %s (%s)", request.method, request.path, exc, cause)
            return _unavailable(str(exc), exc.retry_after_s)
        except PlaneError as exc:
            return error_answer(exc.status, str(exc))
        except web.HTTPException as exc:
            # aiohttp's own refusals (413 past MAX_BODY, 404, 405) are plain text: every
            # error body here is {"error": "..."}.
            if exc.status < 400 or exc.content_type == "application/json":
                raise
            return error_answer(exc.status, exc.text or exc.reason)

    # -- who is calling -------------------------------------------------------------------

    async def _fleet_reader(self, request: web.Request) -> tuple[Role, str | None]:
        """The admin or a cluster: the fleet's supply side and jobs are not a tenant's."""
        role, own = await self.context.caller(request)
        if role is Role.TENANT:
            raise refusal(403, "a tenant key reads its own tenant's objects only", spaced=True)
        return role, own

    # -- routes -------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        why = self.not_ready()
        if why is not None:
            response = json_answer({"ok": False, "error": why}, 503)
            response.headers["Retry-After"] = "1"
            return response
        return json_answer({"ok": True})

    async def _enrol(self, request: web.Request) -> web.Response:
        await self.context.admin(request)
        asked = _ENROL.decode(await request.read())
        try:
            ca = None if asked.ca is None else cluster_ca_of_pem(asked.ca.encode())
        except ValueError:
            return error_answer(400, "ca is the PEM of the cluster's CA certificate")
        cluster_id, token = await self.store.enrol(asked.name, ca)  # 409: the name is taken
        return json_answer({"id": cluster_id, "name": asked.name, "token": token}, 201)

    async def _revoke(self, request: web.Request) -> web.Response:
        await self.context.admin(request)
        cluster_id = request.match_info["id"]
        if not is_id(cluster_id, "clu") or not await self.store.revoke(cluster_id):
            return error_answer(404, f"no active cluster {cluster_id[:40]!r}")
        return json_answer({"revoked": cluster_id})

    async def _clusters(self, request: web.Request) -> web.Response:
        await self.context.admin(request)
        return json_answer(await self.store.clusters())

    async def _cluster(self, request: web.Request) -> web.Response:
        role, own = await self._fleet_reader(request)
        cluster_id = request.match_info["id"]
        if role is Role.CLUSTER and own != cluster_id:
            return error_answer(403, "a cluster token reads its own cluster only")
        if not is_id(cluster_id, "clu"):
            return error_answer(404, f"no cluster {cluster_id[:40]!r}")
        summary = await self.store.fleet_summary(cluster_id=cluster_id)
        if not summary["clusters"]:
            return error_answer(404, f"no cluster {cluster_id[:40]!r}")
        return json_answer(summary["clusters"][0])

    async def _sync(self, request: web.Request) -> web.Response:
        role, cluster_id = await self.context.caller(request)
        if role is not Role.CLUSTER or cluster_id is None:
            return error_answer(403, "sync needs a cluster token")
        if request.content_type != "application/json":
            return error_answer(415, "use Content-Type: application/json")
        signed = read_signature(request.headers)  # none: 403; malformed: 400
        body = await request.read()
        batch = _SYNC_BATCH.decode(body)
        # Only a node speaks for itself: its certificate names batch.nodeId and its key
        # signed these very bytes (SignatureRefused: 403). The CA is bound or checked in
        # the sync's own transaction.
        ca = self.verifier.check(signed, body, node_id=batch.nodeId, now=self._now())
        if b"\\u0000" in body:  # a NUL in a string (JSON must escape it): rare, walk it
            batch = without_nul(batch)
        written = await self.store.sync(cluster_id, batch, ca=ca)  # SyncRefused: 400
        return json_answer({"written": written})

    async def _summary(self, request: web.Request) -> web.Response:
        _, own = await self._fleet_reader(request)
        window = _int_param(request, "window", 3600)
        if window is None or not 1 <= window <= MAX_WINDOW_S:
            return error_answer(400, f"window is a number of seconds from 1 to {MAX_WINDOW_S}")
        return json_answer(await self.store.fleet_summary(window_s=window, cluster_id=own))

    async def _jobs(self, request: web.Request) -> web.Response:
        role, own = await self._fleet_reader(request)
        query = request.query
        cluster = query.get("cluster")
        if role is Role.CLUSTER:
            if cluster not in (None, own):
                return error_answer(403, "a cluster token reads its own cluster only")
            cluster = own
        if cluster is not None and not is_id(cluster, "clu"):
            return error_answer(400, "cluster is a clu_ id")
        state = query.get("state")
        if state is not None and state not in JOB_STATES:
            return error_answer(400, f"state is one of {', '.join(JOB_STATES)}")
        model = query.get("model")
        if model is not None and (len(model) > _MAX_MODEL or "\x00" in model):
            return error_answer(400, f"model is a model name of at most {_MAX_MODEL} characters")
        limit = _int_param(request, "limit", 100)
        if limit is None:
            return error_answer(400, "limit is a number of jobs (1 to 1000)")
        try:
            after = decode_cursor(query["after"]) if "after" in query else None
        except msgspec.DecodeError:
            return error_answer(400, "after is the `next` cursor a previous page gave")
        limit = max(1, min(limit, 1000))
        page, next_cursor = await self.store.jobs(
            cluster_id=cluster, state=state, model=model, after=after, limit=limit
        )
        body: dict[str, Any] = {"jobs": page}
        if next_cursor is not None:
            body["next"] = encode_cursor(next_cursor)
        return json_answer(body)


def _int_param(request: web.Request, name: str, default: int) -> int | None:
    """The integer query parameter `name` (`default` when absent), or None when it is not
    a plain decimal integer of a sane length."""
    text = request.query.get(name)
    if text is None:
        return default
    text = text.strip()
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        return None
    return int(text)
