"""The plane API's answers and request bodies, in one place: a JSON answer, the one error body
`{"error": "..."}` every refusal has, and a JSON request body decoded into a msgspec type,
its size bound, malformed JSON, wrong types and JSON nested past the recursion limit each
refused here as the caller's fault (400, or 413 past the bound).

A refusal goes out one of two ways, and their bytes differ, so each is kept as it was:
`error_answer` is returned by a handler, or made by the server's middleware of a raised
`PlaneError` (`Content-Type: application/json`); `refusal` is an aiohttp error raised from
inside a handler and sent as aiohttp sends text (`application/json; charset=utf-8`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

import msgspec
from aiohttp import web

from plane.core.errors import PlaneError

__all__ = [
    "BodyRefused",
    "BodyTooLarge",
    "JsonBody",
    "body_error",
    "decoded_or_none",
    "error_answer",
    "json_answer",
    "refusal",
]

T = TypeVar("T")

# The words of a body's refusal: fixed text, or text built on msgspec's own account of what
# is wrong ("Expected `int`, got `str` - at `$.replicas`").
Words = str | Callable[[str], str]

_JSON: Final = "application/json"
_NESTED: Final = "nested too deeply"  # msgspec raises RecursionError, with no words of its own
_REFUSALS: Final[dict[int, type[web.HTTPException]]] = {
    400: web.HTTPBadRequest,
    401: web.HTTPUnauthorized,
    403: web.HTTPForbidden,
    404: web.HTTPNotFound,
}


def json_answer(value: Any, status: int = 200) -> web.Response:
    """`value` encoded as JSON, with `status`."""
    return web.Response(body=msgspec.json.encode(value), status=status, content_type=_JSON)


def error_answer(status: int, message: str) -> web.Response:
    """`{"error": message}` with `status`: what a handler returns for a refusal, and what the
    server's middleware answers for a raised `PlaneError`."""
    return json_answer({"error": message}, status)


def refusal(status: int, message: str, *, spaced: bool = False) -> web.HTTPException:
    """`{"error": message}` as an aiohttp error to raise from deep inside a handler (400, 401,
    403, 404 or 413). `spaced` writes it with a space after `:`, as the token checks' answers
    always have been (kept byte for byte)."""
    error = {"error": message}
    text = json.dumps(error) if spaced else msgspec.json.encode(error).decode()
    if status == 413:  # its text is ours: the size aiohttp would have written goes unused
        return web.HTTPRequestEntityTooLarge(0, text=text, content_type=_JSON)
    return _REFUSALS[status](text=text, content_type=_JSON)


class BodyRefused(PlaneError):
    """A request body that is not the JSON its route takes (the caller's fault)."""

    status = 400


class BodyTooLarge(BodyRefused):
    """A request body past its route's bound (the caller's fault)."""

    status = 413


def body_error(status: int, message: str) -> PlaneError:
    """The `PlaneError` for a body refused with `status` (400 or 413), answered by the server's
    middleware."""
    return BodyTooLarge(message) if status == 413 else BodyRefused(message)


class JsonBody(Generic[T]):
    """The JSON body one route takes: the msgspec type it decodes into (its `Decoder` built
    once), at most `most` bytes, and the words of each refusal.

    `malformed` answers bytes that are not JSON, and JSON nested past the recursion limit
    (msgspec's account then being "nested too deeply") unless `nested` has words of its own;
    `invalid` answers JSON of the wrong types (None: as `malformed`); `too_large` a body past
    `most`. `refuse` makes the error raised: a `PlaneError` by default, or `refusal` for a
    route group whose errors go out as aiohttp's.
    """

    def __init__(
        self,
        shape: type[T],
        *,
        malformed: Words,
        invalid: Words | None = None,
        nested: str | None = None,
        most: int | None = None,
        too_large: str = "",
        refuse: Callable[[int, str], Exception] = body_error,
    ) -> None:
        self._decoder = msgspec.json.Decoder(shape)
        self.malformed = malformed
        self.invalid = malformed if invalid is None else invalid
        self.nested = nested
        self.most = most
        self.too_large = too_large
        self.refuse = refuse

    async def read(self, request: web.Request) -> T:
        """The request's body, decoded; raises what `refuse` makes otherwise."""
        return self.decode(await self.read_bytes(request))

    async def read_bytes(self, request: web.Request) -> bytes:
        """The request's body as sent, refused (413) past `most`: by its announced length
        before it is read, or by its length once read."""
        if self.most is not None and (request.content_length or 0) > self.most:
            raise self.refuse(413, self.too_large)
        raw = await request.read()
        if self.most is not None and len(raw) > self.most:
            raise self.refuse(413, self.too_large)
        return raw

    def decode(self, raw: bytes) -> T:
        """`raw` decoded; raises what `refuse` makes (400) when it is not this JSON."""
        try:
            decoded: T = self._decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise self.refuse(400, _said(self.invalid, str(exc))) from exc
        except msgspec.DecodeError as exc:
            raise self.refuse(400, _said(self.malformed, str(exc))) from exc
        except RecursionError as exc:  # msgspec's answer to JSON nested past the limit
            words = self.nested if self.nested is not None else _said(self.malformed, _NESTED)
            raise self.refuse(400, words) from exc
        return decoded


def decoded_or_none(decoder: msgspec.json.Decoder[T], raw: bytes) -> T | None:
    """`raw` decoded, or None when it is not that JSON (malformed, of other types, nested past
    the recursion limit): a look ahead of the body's full decoding, which does the refusing."""
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None


def _said(words: Words, why: str) -> str:
    return words if isinstance(words, str) else words(why)
