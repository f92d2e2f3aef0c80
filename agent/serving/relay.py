"""The facade's answers: the engine's reply passed through to the client, streaming what
streams, and the refusal a client sees when no member can take its request.

Nothing of an engine's error body reaches a job record: a job keeps only the status class,
in the closed vocabulary of `job_errors`. What the answer came to is the event that ends the
job (`job_lifecycle`): `Complete`, or `Fail` with that phrase.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from agent.core.request_identity import passed_back
from agent.engines.client import EngineReply
from agent.serving.job_errors import JobError, for_status
from agent.serving.lifecycle import Complete, Fail, Outcome
from agent.serving.openai_errors import openai_error
from agent.serving.routing import sse_error
from agent.serving.usage import Meter
from netkit.lean_http import Answer, LeanAnswer, LeanRequest, LeanStream
from scheduler import Refusal

__all__ = ["METER", "for_exception", "refused", "relay"]

# The origin's `Meter` of a request, kept in the aiohttp request (aiohttp >= 3.13).
METER: Final = web.RequestKey("nvpair.meter", Meter)

_HOP_HEADERS: Final = ("Content-Type", "Cache-Control")


def refused(refusal: Refusal | None, model: str) -> web.Response:
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


async def relay(
    request: web.Request | LeanRequest,
    reply: aiohttp.ClientResponse,
    *,
    local: bool = True,
    origin: bool = True,
) -> tuple[Answer, Outcome]:
    """Pass the engine's answer through, streaming what streams. A stream that breaks is
    ended with an error event at the `origin` (the member facing the client); a member
    running a forwarded request breaks its own answer instead, so the origin sees it."""
    meter = request.get(METER)  # at the origin: usage and times read on the way
    if reply.status >= 400:
        # The client gets the engine's answer as it is; the job, only the status class.
        body = await reply.read()
        return _whole(request, reply, body), Fail(error=for_status(reply.status))
    if _streams(reply):
        headers = {
            **passed_back(_items(reply)),
            **{h: reply.headers[h] for h in _HOP_HEADERS if h in reply.headers},
        }
        response: web.StreamResponse | LeanStream
        if isinstance(request, LeanRequest):  # the facade's own server (netkit.lean_http)
            response = LeanStream(status=reply.status, headers=headers.items())
            await response.prepare(request)
        else:  # the node API's, running a request another member forwarded
            response = web.StreamResponse(status=reply.status, headers=headers)
            await response.prepare(request)
        try:
            async for chunk in reply.content.iter_any():
                if meter is not None:
                    chunk = meter.feed(chunk)  # the usage chunk stripped if the client did not ask
                await response.write(chunk)
            if meter is not None:
                await response.write(meter.end())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Bytes reached the client: no failover now. End the stream as OpenAI does.
            error = for_exception(exc, local=local)
            if not origin or reply.content_type != "text/event-stream":
                # A forwarded answer, or bytes (audio) that cannot carry an error event: cut.
                if request.transport is not None:
                    request.transport.abort()
                return response, Fail(error=error)
            await response.write(sse_error(error.value))
            await response.write_eof()
            return response, Fail(error=error)
        await response.write_eof()
        return response, Complete()
    body = await reply.read()
    if meter is not None:
        meter.read(body)
    return _whole(request, reply, body), Complete()


def _whole(
    request: web.Request | LeanRequest, reply: aiohttp.ClientResponse, body: bytes
) -> web.Response | LeanAnswer:
    """The engine's whole answer as the server at hand writes it: for the facade's lean
    server, its own answer object (no aiohttp response built and copied per request)."""
    if isinstance(request, LeanRequest):
        return LeanAnswer(reply.status, CIMultiDict(_headers_of(reply)), body)
    return web.Response(status=reply.status, body=body, headers=_headers_of(reply))


def _streams(reply: aiohttp.ClientResponse) -> bool:
    """Whether the answer is passed on as it comes: server-sent events, and a body of
    unknown length that is not JSON (audio the engine streams as it makes it)."""
    if reply.content_type == "text/event-stream":
        return True
    return reply.content_length is None and reply.content_type != "application/json"


def _headers_of(reply: aiohttp.ClientResponse) -> dict[str, str]:
    # The engine's Content-Type as it sent it, parameters (charset) and all, and the
    # headers clients use (agent.core.request_identity.passed_back).
    items = _items(reply)
    given = next((v for k, v in items if k.lower() == "content-type"), None)
    return {**passed_back(items), "Content-Type": given or "application/octet-stream"}


def _items(reply: aiohttp.ClientResponse | EngineReply) -> Iterable[tuple[str, str]]:
    # An engine's answer read by the agent's own client gives its headers as sent; aiohttp's
    # (a member's answer to a forwarded request) as its multidict.
    return reply.header_items() if isinstance(reply, EngineReply) else reply.headers.items()


def for_exception(exc: BaseException, *, local: bool) -> JobError:
    """The error of a job whose call failed with `exc`: on a local engine, or on the member
    it was forwarded to (`local` False), where only "member unreachable" is known here."""
    if not local:
        return JobError.MEMBER_UNREACHABLE
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return JobError.ENGINE_TIMED_OUT
    if isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, aiohttp.ClientConnectorError)
        and isinstance(exc.os_error, ConnectionRefusedError)
    ):
        return JobError.ENGINE_REFUSED
    closed = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionResetError)
    if isinstance(exc, closed):
        return JobError.ENGINE_CLOSED
    return JobError.ENGINE_UNREACHABLE
