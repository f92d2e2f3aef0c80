"""The facade's side of endpoints: a request whose model is an endpoint's public name goes
to the target the routing table picks (`agent.serving.endpoint_routes`).

A target in this cluster is served here: the body's `model` becomes the deployment's name
and the facade's own routing takes it from there (a job like any other). A target in another
cluster gets the request forwarded to one of its facades (the plane's `urls`): same path,
the client's headers (Authorization included: that facade checks the key as its own), the
body with the model rewritten, and the answer streamed back. A forward that fails before
any byte reached the client -- no connection, or 404 / 502 / 503 / 504 -- marks the target
down for a few seconds and the next candidate is tried.

A forwarded request carries `X-Nvpair-Endpoint` (the endpoint's id): the facade that gets
it serves the named deployment and never resolves endpoints again, so two clusters cannot
pass a request back and forth. Bodies are never logged.
"""

from __future__ import annotations

import itertools
import logging
from typing import Final

import aiohttp
from aiohttp import web

from agent.core.request_identity import HEADER as REQUEST_ID
from agent.core.request_identity import outgoing
from agent.serving.endpoint_routes import EndpointRoutes, Pick
from agent.serving.openai_errors import openai_error
from agent.serving.openai_routes import ROUTES, with_model
from agent.serving.relay import relay
from netkit.lean_http import Answer, LeanRequest

__all__ = ["FORWARDED", "EndpointForward"]

log = logging.getLogger(__name__)

FORWARDED: Final = "X-Nvpair-Endpoint"
URLS_TRIED: Final = 2  # of one target's facades, per request
FAILED_STATUSES: Final = frozenset({404, 502, 503, 504})  # that cluster could not take it
# Hop-by-hop headers (RFC 9110 7.6.1) and those the forward sets itself stay behind.
_DROPPED: Final = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Content-Type",
        "Accept-Encoding", REQUEST_ID, FORWARDED,
    )
)  # fmt: skip
_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=5.0)  # answers may stream long


class EndpointForward:
    """Resolves endpoint names for the facade; `aclose()` closes its forwarding client."""

    def __init__(self, table: EndpointRoutes) -> None:
        self.table = table
        self.forwarded = 0  # requests sent to another cluster
        self.failures = 0  # forwards that failed before an answer
        self._session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()  # spreads forwards over a target's facades

    async def aclose(self) -> None:
        """Close the forwarding client."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def route(
        self, request: web.Request | LeanRequest, path: str, raw: bytes, model: str
    ) -> tuple[bytes, str] | Answer:
        """(body, model) to serve here -- unchanged when `model` is no endpoint name -- or
        the answer already given (forwarded to another cluster, or refused)."""
        if FORWARDED in request.headers:
            return raw, model  # another cluster resolved it: its target is ours
        picks = self.table.pick(request.host, model)
        if picks is None:
            return raw, model
        if not picks:
            message = f"no target of the endpoint `{model[:256]}` is up"
            return openai_error(503, message, "server_error")
        sent = request.headers.get("Content-Type", "")
        for pick in picks:
            body = with_model(ROUTES[path], sent, raw, pick.target.name)
            if pick.local:
                return body, pick.target.name
            answer = await self._forward(request, path, body, pick)
            if answer is not None:
                return answer
            self.failures += 1
            self.table.failed(pick.target)
        message = f"no target of the endpoint `{model[:256]}` could take the request"
        return openai_error(502, message, "server_error")

    async def _forward(
        self, request: web.Request | LeanRequest, path: str, body: bytes, pick: Pick
    ) -> Answer | None:
        """The answer of one of the target's facades, or None when none could take it."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        headers.update(outgoing())
        headers["Content-Type"] = ROUTES[path].engine_content_type(
            request.headers.get("Content-Type", "")
        )
        headers[FORWARDED] = pick.route.endpoint
        urls = pick.target.urls
        start = next(self._turn)
        for n in range(min(URLS_TRIED, len(urls))):
            url = urls[(start + n) % len(urls)].rstrip("/") + path
            self.forwarded += 1
            try:
                async with self._session.post(url, data=body, headers=headers) as reply:
                    if reply.status in FAILED_STATUSES:
                        failed = f"status {reply.status}"
                    else:
                        answer, _ = await relay(request, reply, local=False)
                        return answer
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                failed = type(exc).__name__
            log.warning(
                "endpoint %s: forward to %s in %s failed (%s)",
                pick.route.endpoint,
                pick.target.name,
                pick.target.cluster,
                failed,
            )
        return None
