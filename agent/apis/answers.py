"""The answers of the agent's management APIs -- the local API with its page, deployment,
key and usage routes, and the node API -- in their one shape:

- a JSON answer is `application/json`, encoded by msgspec (`json_answer`);
- the guard's refusals (`agent.apis.local_guard`) are JSON `{"error": reason}`
  (`error_answer`);
- bad input is a 400 of one line of text, `what: reason` (`bad_request`), the reason cut
  to `MAX_REASON` characters: it may echo what the client sent;
- a JSON body is read within the app's `client_max_size` (aiohttp answers 413 past it) and
  decoded into its msgspec type, or refused with that 400 (`read_json`, `decoded`):
  malformed, of the wrong types, or nested too deeply (`agent.core.json_input`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec
from aiohttp import web

from agent.core.json_input import BadJson, decode_json

__all__ = ["MAX_REASON", "bad_request", "decoded", "error_answer", "json_answer", "read_json"]

MAX_REASON: Final = 500  # characters of a reason in a 400

T = TypeVar("T")


def json_answer(
    value: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """`value` as a JSON answer."""
    return web.Response(
        status=status,
        body=msgspec.json.encode(value),
        content_type="application/json",
        headers=headers,
    )


def error_answer(
    status: int, reason: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A refusal as JSON: `{"error": reason}`."""
    return json_answer({"error": reason}, status, headers)


def bad_request(reason: str | Exception, what: str = "") -> web.HTTPBadRequest:
    """The 400 for bad input: `what: reason` (or the reason alone), one line of text."""
    why = str(reason)[:MAX_REASON]
    return web.HTTPBadRequest(text=f"{what}: {why}\n" if what else f"{why}\n")


def decoded(decoder: msgspec.json.Decoder[T], body: bytes, what: str = "") -> T:
    """`body` decoded by `decoder`; a `bad_request` saying `what` was wrong when it cannot be."""
    try:
        return decode_json(decoder, body)
    except BadJson as exc:
        raise bad_request(exc, what) from exc


async def read_json(request: web.Request, decoder: msgspec.json.Decoder[T], what: str = "") -> T:
    """The request's body decoded by `decoder` (`decoded`); 413 past `client_max_size`."""
    return decoded(decoder, await request.read(), what)
