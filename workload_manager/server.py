"""The inter-node server: `POST /v1/workloads/events` over cluster mTLS (seed 002).

There is no plaintext mode. The listening context resolves this node's certificate per
handshake (`certs.ServerContexts`), so a node that is not a member keeps the port bound and
fails every handshake, and starts serving when an identity appears. After TLS, every request
passes the pin check (`guard.pinned`): a caller whose key is not in `trusted/` gets 403.

Statuses: 202 (only notifications, all taken; no body), 200 (requests in the body; their
JSON-RPC responses), 400 (a malformed body, or any invalid message in it: the body lists the
errors; valid messages beside them were still taken, which a resend makes harmless),
403 (unpinned), 413 (body over the limit), 415 (not `application/json`), 503 (the broker
is not keeping up: try again after `Retry-After`; nothing was taken).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import Final

from aiohttp import web

from certs import ClusterDir, ServerContexts
from netkit.guard import peer_node_id, pinned
from netkit.keepalive import server_keepalive_s
from netkit.sites import start_runner
from workload_manager.errors import CannotListen, PortInUse
from workload_manager.jsonrpc import INVALID_PARAMS, RpcError, encode_error
from workload_manager.manager import Manager

__all__ = ["EVENTS_PATH", "MAX_BODY", "InterNodeServer"]

log = logging.getLogger(__name__)

EVENTS_PATH: Final = "/v1/workloads/events"
MAX_BODY: Final = 8 * 1024 * 1024
_JSON: Final = "application/json"
_INVALID_NOTE: Final = encode_error(
    None, RpcError(INVALID_PARAMS, "invalid notification").to_object()
)


class InterNodeServer:
    """aiohttp server for peers' workload events; `start()` binds, `aclose()` stops."""

    def __init__(
        self,
        manager: Manager,
        cluster: ClusterDir,
        *,
        host: str | None,
        port: int,
        broker_ready: Callable[[], bool] = lambda: True,
        max_body: int = MAX_BODY,
    ) -> None:
        self.manager = manager
        self.contexts = ServerContexts(cluster)
        self.host = host
        self.port = port
        self.broker_ready = broker_ready
        app = web.Application(client_max_size=max_body)
        app.router.add_post(EVENTS_PATH, pinned(cluster.pins)(self._events))
        self._app = app
        self._runner: web.AppRunner | None = None  # while serving

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0).

        A port in use is `PortInUse`; any other bind failure `CannotListen`.
        """
        try:
            # Members' idle connections outlive their clients' keep-alive (keepalive.py).
            self._runner, self.port = await start_runner(
                self._app,
                self.host,
                self.port,
                ssl_context=self.contexts.listening,
                keepalive_timeout=server_keepalive_s(),
            )
        except OSError as exc:  # start_runner cleaned its runner up
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(self.port, self.host) from exc
            raise CannotListen(self.port, self.host, exc.strerror or str(exc)) from exc
        log.info("inter-node server listening on %s:%d", self.host or "*", self.port)
        return self.port

    async def aclose(self) -> None:
        """Stop serving and close connections."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != _JSON:
            raise web.HTTPUnsupportedMediaType(text=f"use Content-Type: {_JSON}\n")
        body = await request.read()  # aiohttp answers 413 past client_max_size
        if not self.broker_ready():
            # Taking events the broker cannot be told about would lose them; the sender
            # keeps them and retries.
            raise web.HTTPServiceUnavailable(text="broker busy\n", headers={"Retry-After": "1"})
        sender = peer_node_id(request)
        # A batch is relayed just after this answer is written (`defer`): the sender's next
        # batch, on this connection, is read only after that.
        reply = self.manager.handle_remote(body, sender, asyncio.get_running_loop().call_soon)
        if reply.invalid:
            log.warning("peer %s sent %d invalid messages", sender, reply.invalid)
            # Invalid notifications get no JSON-RPC reply (the spec), but the sender must
            # still learn that something was refused: say so in one error object.
            return web.Response(status=400, body=reply.body or _INVALID_NOTE, content_type=_JSON)
        if reply.body is None:
            return web.Response(status=202)
        return web.Response(status=200, body=reply.body, content_type=_JSON)
