"""The plane's HTTP API (aiohttp + psycopg 3 with a connection pool).

Admin calls carry the admin token; cluster calls carry the cluster's `hgro1.` enrolment
token. A cluster token reads and writes its own cluster only. Bad input is a 400 with a
clear message and writes nothing; a wrong or revoked token is a 401.

    POST /v1/clusters {name}            admin   -> {id, token} (the token is shown once)
    POST /v1/clusters/{id}/revoke       admin
    GET  /v1/clusters                   admin
    GET  /v1/clusters/{id}              admin, or that cluster
    POST /v1/sync                       cluster -> one node's SyncBatch
    GET  /v1/fleet/summary?window=3600  admin (a cluster sees itself)
    GET  /v1/jobs?cluster=&state=&model=&after=&limit=   admin, or that cluster
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec
from aiohttp import web

from .ids import is_id
from .store import PlaneStore, SyncBatch, SyncRefused

__all__ = ["PlaneServer"]

log = logging.getLogger(__name__)

MAX_BODY: Final = 32 * 1024 * 1024
_batch_decoder: Final = msgspec.json.Decoder(SyncBatch)
_STATES: Final = ("queued", "running", "completed", "failed", "cancelled")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(value), status=status, content_type="application/json"
    )


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class PlaneServer:
    """`start()` binds, `aclose()` stops."""

    def __init__(self, store: PlaneStore, *, host: str, port: int) -> None:
        self.store = store
        self.host = host
        self.port = port
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/clusters", self._enrol)
        app.router.add_post("/v1/clusters/{id}/revoke", self._revoke)
        app.router.add_get("/v1/clusters", self._clusters)
        app.router.add_get("/v1/clusters/{id}", self._cluster)
        app.router.add_post("/v1/sync", self._sync)
        app.router.add_get("/v1/fleet/summary", self._summary)
        app.router.add_get("/v1/jobs", self._jobs)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start(self) -> int:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def aclose(self) -> None:
        await self._runner.cleanup()

    # -- who is calling -------------------------------------------------------------------

    async def _caller(self, request: web.Request) -> tuple[str, str | None]:
        """("admin", None) or ("cluster", id); raises 401 otherwise."""
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.startswith("Bearer ") else ""
        if token:
            cluster = await self.store.cluster_for(token)
            if cluster is not None:
                return "cluster", cluster
            if await self.store.is_admin(token):
                return "admin", None
        raise web.HTTPUnauthorized(
            text='{"error": "a valid admin or cluster token is required"}',
            content_type="application/json",
        )

    async def _admin(self, request: web.Request) -> None:
        role, _ = await self._caller(request)
        if role != "admin":
            raise web.HTTPForbidden(
                text='{"error": "this call needs the admin token"}',
                content_type="application/json",
            )

    # -- routes -------------------------------------------------------------------------------

    async def _enrol(self, request: web.Request) -> web.Response:
        await self._admin(request)
        try:
            name = (await request.json())["name"]
            if not isinstance(name, str) or not 1 <= len(name) <= 128:
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return _error(400, 'the body is {"name": "1 to 128 characters"}')
        try:
            cluster_id, token = await self.store.enrol(name)
        except Exception as exc:  # a duplicate name, say
            return _error(400, f"cannot enrol {name!r}: {type(exc).__name__}")
        return _json({"id": cluster_id, "name": name, "token": token}, 201)

    async def _revoke(self, request: web.Request) -> web.Response:
        await self._admin(request)
        cluster_id = request.match_info["id"]
        if not await self.store.revoke(cluster_id):
            return _error(404, f"no active cluster {cluster_id[:40]!r}")
        return _json({"revoked": cluster_id})

    async def _clusters(self, request: web.Request) -> web.Response:
        await self._admin(request)
        return _json(await self.store.clusters())

    async def _cluster(self, request: web.Request) -> web.Response:
        role, own = await self._caller(request)
        cluster_id = request.match_info["id"]
        if role == "cluster" and own != cluster_id:
            return _error(403, "a cluster token reads its own cluster only")
        summary = await self.store.fleet_summary(cluster_id=cluster_id)
        if not summary["clusters"]:
            return _error(404, f"no cluster {cluster_id[:40]!r}")
        return _json(summary["clusters"][0])

    async def _sync(self, request: web.Request) -> web.Response:
        role, cluster_id = await self._caller(request)
        if role != "cluster" or cluster_id is None:
            return _error(403, "sync needs a cluster token")
        if request.content_type != "application/json":
            return _error(415, "use Content-Type: application/json")
        try:
            batch = _batch_decoder.decode(await request.read())
            written = await self.store.sync(cluster_id, batch)
        except msgspec.DecodeError as exc:
            return _error(400, f"malformed sync batch: {exc}")
        except SyncRefused as exc:
            return _error(400, str(exc))
        return _json({"written": written})

    async def _summary(self, request: web.Request) -> web.Response:
        _, own = await self._caller(request)
        try:
            window = int(request.query.get("window", "3600"))
        except ValueError:
            return _error(400, "window is a number of seconds")
        return _json(await self.store.fleet_summary(window_s=window, cluster_id=own))

    async def _jobs(self, request: web.Request) -> web.Response:
        role, own = await self._caller(request)
        query = request.query
        cluster = query.get("cluster")
        if role == "cluster":
            if cluster not in (None, own):
                return _error(403, "a cluster token reads its own cluster only")
            cluster = own
        if cluster is not None and not is_id(cluster, "clu"):
            return _error(400, "cluster is a clu_ id")
        state = query.get("state")
        if state is not None and state not in _STATES:
            return _error(400, f"state is one of {', '.join(_STATES)}")
        try:
            limit = max(1, min(int(query.get("limit", "100")), 1000))
            after = msgspec.json.decode(query["after"]) if "after" in query else None
            if after is not None and (not isinstance(after, list) or len(after) != 5):
                raise ValueError
        except (ValueError, msgspec.DecodeError):
            return _error(400, "limit is a number and after is the cursor a previous page gave")
        page, next_cursor = await self.store.jobs(
            cluster_id=cluster, state=state, model=query.get("model"), after=after, limit=limit
        )
        body: dict[str, Any] = {"jobs": page}
        if next_cursor is not None:
            body["next"] = msgspec.json.encode(next_cursor).decode()
        return _json(body)
