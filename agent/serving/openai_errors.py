"""Errors in the shape OpenAI clients parse, for every answer the facade gives -- its own
refusals and aiohttp's (an unknown path, a method the path does not take, a body too large),
which would otherwise be plain text that no OpenAI client can read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = ["openai_error", "openai_errors"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    """An error in the shape OpenAI clients parse."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


@web.middleware
async def _middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        path = request.path[:200]
        return openai_error(404, f"no route {request.method} {path}", "invalid_request_error",
                            "unknown_url")  # fmt: skip
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = openai_error(
            405, f"{request.method} is not allowed here (allowed: {allowed})",
            "invalid_request_error", "method_not_allowed",
        )  # fmt: skip
        response.headers["Allow"] = allowed
        return response


def openai_errors() -> Middleware:
    """The middleware: aiohttp's 404 and 405 as OpenAI-shaped JSON."""
    return _middleware
