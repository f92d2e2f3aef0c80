"""Errors in the shape OpenAI clients parse, for every answer the facade gives -- its own
refusals and its server's (an unknown path, a method the path does not take, a body or
headers too large, a malformed request: `netkit.lean_http` asks `refusal` for its words) --
and the facade's own JSON answers. A body's JSON is decoded by `agent.core.json_input`
(`openai_routes`)."""

from __future__ import annotations

from typing import Final

import msgspec
from aiohttp import web

__all__ = ["json_answer", "not_allowed", "openai_error", "refusal"]

_REFUSAL_CODES: Final = {
    400: None, 413: "request_too_large", 414: "url_too_long", 431: "request_headers_too_large"
}  # fmt: skip


def json_answer(value: object, status: int = 200) -> web.Response:
    """`value` as a JSON answer of the facade's own (not an engine's, which passes as sent)."""
    return web.Response(
        status=status, body=msgspec.json.encode(value), content_type="application/json"
    )


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    """An error in the shape OpenAI clients parse."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json_answer(body, status)


def refusal(status: int, message: str) -> web.Response:
    """The facade's lean server's own refusals (`netkit.lean_http`: a body or headers too
    large, a malformed request), OpenAI-shaped like every other answer of the facade."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return openai_error(status, message, kind, _REFUSAL_CODES.get(status))


def not_allowed(method: str, allowed: str) -> web.Response:
    """A path the facade serves, asked with a method it does not take (405)."""
    response = openai_error(
        405, f"{method[:16]} is not allowed here (allowed: {allowed})",
        "invalid_request_error", "method_not_allowed",
    )  # fmt: skip
    response.headers["Allow"] = allowed
    return response
