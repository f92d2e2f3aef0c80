"""The node API on 14321: node records between members, and joining.

Cluster mTLS like the workload manager's port, with one difference: a caller without a
certificate completes the handshake (a certificate that is sent must still chain to the
cluster CA), because a joiner has none yet. Every route but the join routes then requires a
pinned caller (403 otherwise).

- `GET /v1/cluster/ca` -- the CA certificate, for a joiner to check against its invite's
  fingerprint before it sends anything secret.
- `POST /v1/join` -- an invite's `JoinRequest`; answers the `JoinResponse` plus the records
  this node holds, so the new member knows where its peers are. Only a CA holder admits.
- `POST /v1/records` (pinned) -- a `RecordsPush`; answered with this node's own push, so one
  round trip exchanges both views.
- `POST /v1/forward`, `/v1/cordon`, `/v1/cancel` (pinned) -- a request placed here, a cordon
  of this node, a forced drain's cancellations.
- `POST /v1/repair/digest`, `/v1/repair/exchange` (pinned) -- anti-entropy rounds
  (`broker.anti_entropy`): a digest in, the differing keys out; records both ways.
- `POST /v1/members/ping`, `/v1/members/ping-req` (pinned) -- probes (`facts.probing`).
- `POST /v1/limits/lease` (pinned) -- API keys' limits: a member's leases and token reports
  for the keys this member holds the counts of (`agent.serving.cluster_limits`).
- `GET /v1/tunnel/{replica}` (pinned, WebSocket) -- a spanning replica's head reaching a
  worker part's engine here (`agent.engines.tunnel`): only the head's member is let through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import msgspec
from aiohttp import web

from agent.apis.answers import json_answer, read_json
from agent.artifacts.counters import ArtifactCounters
from agent.artifacts.pace import Pace
from agent.artifacts.store import ArtifactStore, StoreError
from agent.cluster.members import Incompatible
from agent.cluster.probes import Probes
from agent.core.lifetime import SHUTDOWN_S
from agent.serving.openai_routes import ROUTES, read_body
from broker.anti_entropy import Differences, Digest, Exchange, ExchangeAnswer
from certs import (
    FORWARD_ALPN,
    ClusterDir,
    InviteRefused,
    JoinRequest,
    NotCAHolder,
    ServerContexts,
    admit,
    pinned_peer,
)
from certs.invites import Tombstone
from facts.api_keys import ApiKey
from facts.artifact_fetch import to_bitmap
from facts.kept import Kept, raws
from facts.key_limits import LeaseAnswer, LeaseAsk
from facts.probing import Ping, PingReq
from facts.records import NodeRecord, RecordsPush, push_decoder
from netkit.guard import Handler, peer_node_id, pinned
from netkit.lean_http import Answer, LeanApp, LeanRequest
from netkit.sites import PerSourceRate, start_runner

__all__ = ["JoinAnswer", "NodeApi"]

PIECE_READS: Final = 4  # artifact pieces read for members at once (each up to 64 MiB)
BUSY_S: Final = 1.0  # a paced member with this much already booked answers 503 (busy)
_BUSY: Final = {"Retry-After": "1"}
# NVPAIR_TEST_CORRUPT_PIECES=1: this member flips a byte of every artifact piece it serves
# (the mixed-fault tests' corrupting member; never set it on a member that serves). Read
# when the API is built, not at import.
_CORRUPT_ENV: Final = "NVPAIR_TEST_CORRUPT_PIECES"
_HEX: Final = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger(__name__)

MAX_BODY: Final = 4 * 1024 * 1024
MAX_FORWARD: Final = max(route.limit for route in ROUTES.values())  # a forwarded body, at most
JOIN_BURST: Final = 20  # joins one source may try at once (a few nodes, a few typos)
JOINS_PER_S: Final = 0.1  # then one each 10 s
_join_decoder: Final = msgspec.json.Decoder(JoinRequest)


class _Cordon(msgspec.Struct, frozen=True):
    cordoned: bool


class _Cancel(msgspec.Struct, frozen=True):
    target: str


_cordon_decoder: Final = msgspec.json.Decoder(_Cordon)
_digest_decoder: Final = msgspec.json.Decoder(Digest)
_exchange_decoder: Final = msgspec.json.Decoder(Exchange)
_cancel_decoder: Final = msgspec.json.Decoder(_Cancel)
_ping_decoder: Final = msgspec.json.Decoder(Ping)
_ping_req_decoder: Final = msgspec.json.Decoder(PingReq)
_lease_decoder: Final = msgspec.json.Decoder(LeaseAsk)
_JSON: Final = "application/json"

T = TypeVar("T")


class JoinAnswer(msgspec.Struct, kw_only=True, frozen=True):
    """What `POST /v1/join` answers."""

    cert: str
    ca: str
    pins: list[str]
    records: list[msgspec.Raw]  # NodeRecord, as each member signed it (facts.kept)
    removed: list[Tombstone] = []
    apiKeys: list[msgspec.Raw] = []  # ApiKey, as signed: a joiner starts with the keys


class NodeApi:
    """The aiohttp server of the node API."""

    def __init__(
        self,
        cluster: ClusterDir,
        *,
        host: str | None,
        port: int,
        on_push: Callable[[RecordsPush, str], RecordsPush],
        on_admitted: Callable[[], None],
        records: Callable[[], list[Kept[NodeRecord]]],
        run_here: Callable[[web.Request | LeanRequest, str, bytes], Awaitable[Answer]]
        | None = None,
        on_cordon: Callable[[bool], None] = lambda cordoned: None,
        on_cancel: Callable[[str], int] = lambda target: 0,
        on_digest: Callable[[Digest], Awaitable[Differences]] | None = None,
        on_exchange: Callable[[Exchange], Awaitable[ExchangeAnswer]] | None = None,
        api_keys: Callable[[], list[Kept[ApiKey]]] = list,
        probes: Probes | None = None,
        refusal: Callable[[str], str | None] = lambda node_id: None,
        artifacts: ArtifactStore | None = None,
        artifact_pace: Pace | None = None,
        artifact_counters: ArtifactCounters | None = None,
        on_lease: Callable[[LeaseAsk], LeaseAnswer] | None = None,
        tunnel: Handler | None = None,
    ) -> None:
        self.on_lease = on_lease  # the keys' limits this member holds (cluster_limits)
        self.artifacts = artifacts  # the pieces this member serves (issue 28)
        self._pace = artifact_pace if artifact_pace is not None else Pace(0)
        self._served = artifact_counters if artifact_counters is not None else ArtifactCounters()
        self._corrupt = os.environ.get(_CORRUPT_ENV) == "1"
        if self._corrupt:
            log.warning("NVPAIR_TEST_CORRUPT_PIECES: this member corrupts every piece it serves")
        # Pieces read for members at once: each is held whole, up to 64 MiB.
        self._piece_reads = asyncio.Semaphore(PIECE_READS)
        self.probes = probes
        self.refusal = refusal  # why a member's calls are refused: wire ranges apart
        self.api_keys = api_keys
        self.on_digest = on_digest
        self.on_exchange = on_exchange
        self.run_here = run_here
        self.on_cordon = on_cordon
        self.on_cancel = on_cancel
        self.cluster = cluster
        # Forwarded inference agrees on FORWARD_ALPN and is served by the lean server
        # (`_lean_forward`); everything else by aiohttp, on the same port.
        self.contexts = ServerContexts(cluster, client_certificate="optional", alpn=(FORWARD_ALPN,))
        self.host = host
        self.port = port
        self.on_push = on_push
        self.on_admitted = on_admitted
        self.records = records
        # /v1/join is open to strangers (an invite is checked inside): a few tries per source,
        # then one each 10 s; refusals are logged at most one line per 10 s, with a count.
        self._joins = PerSourceRate(per_s=JOINS_PER_S, burst=JOIN_BURST)
        self._refusal_lines = PerSourceRate(per_s=0.1, burst=1)
        self.joins_refused = 0
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/v1/cluster/ca", self._ca)
        app.router.add_post("/v1/join", self._join)
        app.router.add_post("/v1/records", pinned(cluster.pins)(self._push))
        app.router.add_post("/v1/forward", pinned(cluster.pins)(self._working(self._forward)))
        app.router.add_post("/v1/cordon", pinned(cluster.pins)(self._working(self._cordon)))
        app.router.add_post("/v1/cancel", pinned(cluster.pins)(self._working(self._cancel)))
        app.router.add_post(
            "/v1/repair/digest", pinned(cluster.pins)(self._working(self._repair_digest))
        )
        app.router.add_post(
            "/v1/repair/exchange", pinned(cluster.pins)(self._working(self._repair_exchange))
        )
        app.router.add_post("/v1/members/ping", pinned(cluster.pins)(self._working(self._ping)))
        app.router.add_post(
            "/v1/members/ping-req", pinned(cluster.pins)(self._working(self._ping_req))
        )
        app.router.add_post("/v1/limits/lease", pinned(cluster.pins)(self._working(self._lease)))
        if tunnel is not None:  # a spanning replica's engine channel (agent.engines.tunnel)
            app.router.add_get("/v1/tunnel/{replica}", pinned(cluster.pins)(self._working(tunnel)))
        for path, handler in (
            ("/v1/artifacts/{hex}/manifest", self._manifest),
            ("/v1/artifacts/{hex}/held", self._held),
            ("/v1/artifacts/{hex}/pieces/{piece}", self._piece),
        ):
            app.router.add_get(path, pinned(cluster.pins)(self._working(handler)))
        self._app = app
        self._runner: web.AppRunner | None = None  # while serving

    def _working(self, handler: Handler) -> Handler:
        """`handler` for members this one works with; a member whose wire range does not
        overlap this one's is answered 409 with why (`facts.wire.refusal`)."""

        async def checked(request: web.Request) -> web.StreamResponse:
            why = self.refusal(peer_node_id(request))
            if why is not None:
                raise web.HTTPConflict(text=f"{why}\n")
            return await handler(request)

        return checked

    async def start(self) -> int:
        """Bind and serve; returns the port (OSError when it is in use)."""
        # handler_cancellation: when the placing member's connection goes (its client hung
        # up, a forced drain cancelled it), the forwarded request here is cancelled too, and
        # with it the engine's generation -- no GPU time spent on an answer nobody reads.
        self._runner, self.port = await start_runner(
            self._app,
            self.host,
            self.port,
            ssl_context=self.contexts.listening,
            shutdown_timeout=SHUTDOWN_S,
            handler_cancellation=True,
            lean=(FORWARD_ALPN, LeanApp(self._lean_forward, lambda _m, _p: MAX_FORWARD, _plain)),
        )
        return self.port

    async def aclose(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ca(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.cluster.ca_crt.read_bytes(), content_type="application/x-pem-file"
        )

    def _refuse_join(self, source: str, why: str) -> None:
        self.joins_refused += 1
        if self._refusal_lines.allow("join"):
            log.warning("refused a join from %s: %s (%d refused)", source, why, self.joins_refused)

    async def _join(self, request: web.Request) -> web.Response:
        source = request.remote or "?"
        if not self._joins.allow(source):
            self._refuse_join(source, "too many tries")
            raise web.HTTPTooManyRequests(
                text="too many joins from this address: try again later\n",
                headers={"Retry-After": str(int(1 / JOINS_PER_S))},
            )
        if request.content_type != _JSON:
            raise web.HTTPUnsupportedMediaType(text=f"use Content-Type: {_JSON}\n")
        join = await read_json(request, _join_decoder, "not a join request")
        try:
            answer = admit(self.cluster, join)
        except NotCAHolder:
            raise web.HTTPConflict(
                text="this member holds no CA key: join through a CA holder\n"
            ) from None
        except InviteRefused as exc:
            self._refuse_join(source, str(exc))
            raise web.HTTPForbidden(text=f"{exc}\n") from None
        self.on_admitted()
        body = JoinAnswer(
            cert=answer.cert,
            ca=answer.ca,
            pins=answer.pins,
            records=raws(self.records()),
            removed=answer.removed,
            apiKeys=raws(self.api_keys()),
        )
        return json_answer(body)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        # A member placed a request here: run it on a local engine and stream the answer.
        # The job's events are the placing member's to send (one writer per job).
        # Each route's own body limit (an audio form's is over MAX_BODY), not aiohttp's.
        path = request.headers.get("X-Nvpair-Path", "")
        route = ROUTES.get(path)
        if route is None or self.run_here is None:
            raise web.HTTPBadRequest(text="X-Nvpair-Path names an inference route\n")
        body = await read_body(request, route.limit)
        if body is None:
            raise web.HTTPRequestEntityTooLarge(route.limit, request.content_length or -1)
        answer = await self.run_here(request, path, body)
        assert isinstance(answer, web.StreamResponse)  # an aiohttp request is answered so
        return answer

    async def _lean_forward(self, request: LeanRequest) -> Answer:
        """`POST /v1/forward` on a connection that agreed on `FORWARD_ALPN`: the same
        checks as aiohttp's route (the caller's pin on every request, its wire range, the
        route's body limit), served without aiohttp's application stack (issue 33)."""
        if request.path != "/v1/forward" or request.method != "POST":
            return _plain(404, "only POST /v1/forward is served on this connection")
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        peer = pinned_peer(ssl_object, self.cluster.pins)
        if peer is None:
            return _plain(403, "forbidden")
        why = self.refusal(peer)
        if why is not None:
            return _plain(409, why)
        route = ROUTES.get(request.headers.get("X-Nvpair-Path", ""))
        if route is None or self.run_here is None:
            return _plain(400, "X-Nvpair-Path names an inference route")
        if len(request.body) > route.limit:
            return _plain(413, f"the body is over {route.limit} bytes")
        return await self.run_here(request, route.path, request.body)

    async def _cordon(self, request: web.Request) -> web.Response:
        # A member's cordon or drain operation targets this node: only it speaks for itself.
        cordoned = (await read_json(request, _cordon_decoder, "not a cordon request")).cordoned
        self.on_cordon(cordoned)
        return web.json_response({"cordoned": cordoned})

    async def _cancel(self, request: web.Request) -> web.Response:
        # A forced drain: cancel what this node's facade placed on the target.
        target = (await read_json(request, _cancel_decoder, "not a cancel request")).target
        return web.json_response({"cancelled": self.on_cancel(target)})

    async def _repair_digest(self, request: web.Request) -> web.Response:
        # Anti-entropy from a member: its digest in, our keys where the stores differ out.
        return await _repair(request, _digest_decoder, self.on_digest)

    async def _repair_exchange(self, request: web.Request) -> web.Response:
        return await _repair(request, _exchange_decoder, self.on_exchange)

    async def _ping(self, request: web.Request) -> web.Response:
        probes = self.probes
        answer = (
            None if probes is None else (lambda p: _now(probes.on_ping(p, peer_node_id(request))))
        )
        return await _repair(request, _ping_decoder, answer)

    async def _ping_req(self, request: web.Request) -> web.Response:
        answer = None if self.probes is None else self.probes.on_ping_req
        return await _repair(request, _ping_req_decoder, answer)

    async def _lease(self, request: web.Request) -> web.Response:
        ask = await read_json(request, _lease_decoder, "not a lease request")
        if self.on_lease is None:
            raise web.HTTPServiceUnavailable(text="this member holds no key limits\n")
        return json_answer(self.on_lease(ask))

    async def _push(self, request: web.Request) -> web.Response:
        if request.content_type != _JSON:
            raise web.HTTPUnsupportedMediaType(text=f"use Content-Type: {_JSON}\n")
        push = await read_json(request, push_decoder, "not a records push")
        try:
            return json_answer(self.on_push(push, peer_node_id(request)))
        except Incompatible as exc:
            raise web.HTTPConflict(text=f"{exc}\n") from None

    def _store_and_digest(self, request: web.Request) -> tuple[ArtifactStore, str]:
        hexed = request.match_info["hex"]
        if not _HEX.fullmatch(hexed):
            raise web.HTTPBadRequest(text="not an artifact digest (64 lowercase hex digits)\n")
        if self.artifacts is None:
            raise web.HTTPNotFound(text="this member keeps no artifacts\n")
        return self.artifacts, f"sha256:{hexed}"

    async def _manifest(self, request: web.Request) -> web.Response:
        # A member fetching an artifact asks for its manifest first, by digest: it checks
        # the bytes against the digest itself (facts.artifacts), so any member may answer.
        store, digest = self._store_and_digest(request)
        manifest = await asyncio.to_thread(store.manifest, digest)
        if manifest is None:
            raise web.HTTPNotFound(text="no such artifact here\n")
        return web.Response(body=msgspec.json.encode(manifest), content_type=_JSON)

    async def _held(self, request: web.Request) -> web.Response:
        store, digest = self._store_and_digest(request)
        manifest = await asyncio.to_thread(store.manifest, digest)
        if manifest is None:
            raise web.HTTPNotFound(text="no such artifact here\n")
        held = await asyncio.to_thread(store.held, digest)
        count = manifest.piece_count
        return json_answer({"count": count, "bitmap": to_bitmap(held, count)})

    async def _piece(self, request: web.Request) -> web.Response:
        store, digest = self._store_and_digest(request)
        text = request.match_info["piece"]
        if not text.isdigit() or len(text) > 7:
            raise web.HTTPBadRequest(text="not a piece number\n")
        if self._pace.backlog() > BUSY_S:
            # Its link is booked for a while ([artifacts] max_rate): the member asks another
            # holder now rather than wait in line here (every receiver is a source).
            raise web.HTTPServiceUnavailable(text="busy serving pieces\n", headers=_BUSY)
        async with self._piece_reads:  # pieces in memory: at most PIECE_READS, paced ones too
            try:
                data = await asyncio.to_thread(store.read_piece, digest, int(text))
            except StoreError:
                data = None
            if data is None:
                raise web.HTTPNotFound(text="no such piece here\n")
            await self._pace.take(len(data))  # [artifacts] max_rate
        if self._corrupt and data:  # a stand-in for a member whose disk or memory corrupts pieces
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self._served.served(peer_node_id(request), len(data))
        return web.Response(body=data, content_type="application/octet-stream")


def _plain(status: int, message: str) -> web.Response:
    """A node API answer in its plain-text shape (as aiohttp's HTTP errors are)."""
    return web.Response(status=status, text=f"{message}\n")


async def _now(value: object) -> object:
    return value


async def _repair(
    request: web.Request,
    decoder: msgspec.json.Decoder[T],
    answer: Callable[[T], Awaitable[object]] | None,
) -> web.Response:
    if answer is None:
        raise web.HTTPServiceUnavailable(text="anti-entropy is not running here\n")
    value = await read_json(request, decoder, "not a repair request")
    return json_answer(await answer(value))
