"""The per-request pin check for aiohttp servers behind cluster mTLS.

TLS proves the caller holds a certificate of the cluster CA; the guard then asks the pin
store whether its key belongs to a current member (`certs.pinned_peer`), on every request.
That is what refuses a removed member on a kept-alive connection or a resumed TLS session,
where no new handshake happens. A refused caller gets a bare 403: nothing about why.

`PinnedConnector` is the client's side of it: a connection to a member is used only when
the server's certificate is the pin of the member the request is for.

It lives with the servers rather than in `certs` so that `import certs` loads no aiohttp.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace
from aiohttp.typedefs import Middleware

from certs import PinStore, pinned_peer
from certs.ids import DNS_SUFFIX

__all__ = [
    "PEER_NODE_ID",
    "PinnedConnector",
    "caller_node_id",
    "peer_node_id",
    "pin_guard",
    "pinned",
]

PEER_NODE_ID: Final = web.RequestKey("nvpair.peer_node_id", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def pin_guard(pins: PinStore) -> Middleware:
    """An aiohttp middleware: 403 unless the caller's key is pinned."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        _admit(request, pins)
        return await handler(request)

    return guard


def pinned(pins: PinStore) -> Callable[[Handler], Handler]:
    """The same check as `pin_guard`, as a handler decorator.

    aiohttp builds a wrapper per middleware on every request; a decorated handler skips that,
    which is measurable on the hot inter-node endpoints (bench/pin_check.py).
    """

    def decorate(handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            _admit(request, pins)
            return await handler(request)

        return guarded

    return decorate


def _admit(request: web.Request, pins: PinStore) -> None:
    node_id = caller_node_id(request, pins)
    if node_id is None:
        raise web.HTTPForbidden(text="forbidden\n")
    request[PEER_NODE_ID] = node_id


def caller_node_id(request: web.BaseRequest, pins: PinStore) -> str | None:
    """The pinned member behind this request, or None."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return pinned_peer(ssl_object, pins)


def peer_node_id(request: web.Request) -> str:
    """The caller's node id, set by `pin_guard` or `pinned`."""
    return request[PEER_NODE_ID]


class PinnedConnector(aiohttp.TCPConnector):
    """Connections to members that check whom they reached: after the handshake the server's
    certificate must be the pin of the member the request is for (named by its server
    hostname, `server_hostname_for`), or the connection is closed before a byte of the
    request goes out. TLS alone proves only a certificate of the cluster CA; a record that
    points a member's address elsewhere must not get that member's traffic. Pooled
    connections are keyed by server hostname too, so one checked for a member serves only
    requests for that member."""

    def __init__(self, pins: PinStore, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pins = pins

    async def _create_connection(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> ResponseHandler:
        proto = await super()._create_connection(req, traces, timeout)
        hostname = req.server_hostname or ""
        expected = hostname.removesuffix(DNS_SUFFIX) if hostname.endswith(DNS_SUFFIX) else None
        transport = proto.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        if expected is None or pinned_peer(ssl_object, self._pins) != expected:
            proto.close()
            raise aiohttp.ClientConnectionError(
                f"the server at {req.url.host}:{req.url.port} is not {expected or hostname!r}: "
                "its certificate is not that member's pin"
            )
        return proto
