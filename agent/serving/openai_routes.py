"""The OpenAI routes the facade serves as jobs, and how each names its model: one table for
the facade and for the node API's forward allow-list.

Every route is byte-transparent: the body goes to the engine as the client sent it, and the
answer comes back as the engine sent it. Only the model is read, to route by: from a JSON
body's `model`, or from the `model` field of a `multipart/form-data` body (the audio
routes), found in the bytes already held by a small strict parser of the multipart framing
(RFC 7578 / RFC 2046), so the file is neither buffered twice nor re-encoded.

Pure: no I/O here but `read_body`, which reads a request's body with the route's limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from aiohttp import web

from agent.core.json_input import BadJson, decode_json
from netkit.lean_http import LeanRequest

__all__ = [
    "AUDIO_MAX_BODY",
    "JSON_MAX_BODY",
    "OTHER_BODY",
    "ROUTES",
    "BadBody",
    "Route",
    "body_limit",
    "form_model",
    "json_model",
    "json_request",
    "model_object",
    "model_of",
    "read_body",
    "with_model",
]

JSON_MAX_BODY: Final = 8 * 1024 * 1024
AUDIO_MAX_BODY: Final = 25 * 1024 * 1024  # OpenAI's limit for an audio file
MAX_MODEL_NAME: Final = 1024  # bytes of a form's `model` value
MAX_PARTS: Final = 1000  # parts of one form (OpenAI's audio forms have a dozen)
MAX_PART_HEAD: Final = 8 * 1024  # bytes of one part's header block
_JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class Route:
    """A POST route: the model is a JSON body's `model` or (`form`) a form field;
    `prompted`: its requests carry a prompt an engine's prefix cache can reuse (routed by
    their anchor, `scheduler.prefix`)."""

    path: str
    form: bool = False
    limit: int = JSON_MAX_BODY
    prompted: bool = False

    def engine_content_type(self, sent: str) -> str:
        """The Content-Type the engine gets: a form's own (its boundary frames the body);
        for JSON, application/json -- the body was read as JSON, whatever the client called
        it (`curl -d` says x-www-form-urlencoded), as the facade has always sent it."""
        return sent if self.form else _JSON


def _routes(*routes: Route) -> dict[str, Route]:
    return {route.path: route for route in routes}


ROUTES: Final = _routes(
    Route("/v1/chat/completions", prompted=True),
    Route("/v1/completions", prompted=True),
    Route("/v1/embeddings"),
    # Rerank as vLLM serves it, under each path a client family uses: Jina and vLLM's own
    # clients /v1/rerank, Cohere's v2 client /v2/rerank, Cohere's v1 client /rerank. The
    # engine gets the path the client used.
    Route("/v1/rerank"),
    Route("/v2/rerank"),
    Route("/rerank"),
    Route("/v1/score"),
    Route("/v1/audio/transcriptions", form=True, limit=AUDIO_MAX_BODY),
    Route("/v1/audio/translations", form=True, limit=AUDIO_MAX_BODY),
    Route("/v1/audio/speech"),
    Route("/v1/images/generations"),
    Route("/v1/responses", prompted=True),
)


class BadBody(Exception):
    """The client's body names no model we can read: a 400 with this message."""


OTHER_BODY: Final = 1 << 20  # what a request to any other path may carry (read, unused)


def body_limit(method: str, path: str) -> int:
    """The most a request's body may be on the facade: its route's bound, else
    `OTHER_BODY` (the lean server refuses more before the handler runs)."""
    route = ROUTES.get(path)
    return route.limit if route is not None and method == "POST" else OTHER_BODY


async def read_body(request: web.BaseRequest | LeanRequest, limit: int) -> bytes | None:
    """The request's body, or None when it is over `limit` bytes (refused by its
    Content-Length before any of it is read, else as soon as it passes the limit; the
    facade's lean server has read it already, within its route's bound)."""
    if isinstance(request, LeanRequest):
        return request.body if len(request.body) <= limit else None
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


# The whole body is decoded, not just `model`: a body that is not valid JSON throughout (bad
# UTF-8 or an out-of-range number in another field) is the client's 400 here, not a job the
# engine then refuses.
_whole: Final = msgspec.json.Decoder(dict[str, Any])


def json_model(body: bytes) -> str:
    """The `model` string of a JSON object (the last one, as Python's json reads it)."""
    return json_request(body)[0]


def json_request(body: bytes) -> tuple[str, dict[str, Any]]:
    """The `model` string of a JSON object and the whole object, decoded once."""
    try:
        whole = decode_json(_whole, body)
    except BadJson:
        raise BadBody("the body must be JSON with a model") from None
    model = whole.get("model")
    if not isinstance(model, str) or not model:
        raise BadBody("the body must be JSON with a model")
    return model, whole


def model_of(route: Route, content_type: str, body: bytes) -> str:
    """The model `body` names, read as `route` says (BadBody when it names none)."""
    return form_model(content_type, body) if route.form else json_model(body)


# RFC 2046 bchars, 1 to 70 of them, not ending in a space.
_BOUNDARY: Final = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
# A parameter of a header value: `; name=token` or `; name="quoted \" string"`.
_PARAM: Final = re.compile(r';\s*([!#$%&\'*+\-.^_`|~0-9A-Za-z]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


def _params(value: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for name, raw in _PARAM.findall(value):
        text = raw[1:-1].replace('\\"', '"').replace("\\\\", "\\") if raw[:1] == '"' else raw
        params.setdefault(name.lower(), text)
    return params


def _boundary(content_type: str) -> bytes:
    kind, _, rest = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise BadBody("the body must be multipart/form-data")
    boundary = _params(";" + rest).get("boundary", "")
    if not _BOUNDARY.fullmatch(boundary):
        raise BadBody("the multipart/form-data Content-Type has no valid boundary")
    return boundary.encode("ascii")


def _field_name(head: bytes) -> str | None:
    """The `name` of a part's `Content-Disposition: form-data` header, if it has one."""
    for line in head.split(b"\r\n"):
        field, colon, value = line.partition(b":")
        if colon and field.strip().lower() == b"content-disposition":
            text = value.decode("utf-8", "replace")
            if text.partition(";")[0].strip().lower() != "form-data":
                return None
            return _params(text).get("name")
    return None


def form_model(content_type: str, body: bytes) -> str:
    """The value of the one `model` field of a multipart/form-data body; BadBody when the
    framing is malformed or the form names no model, or names it more than once (an engine
    may read the first or the last: routing must agree with it, so neither is guessed)."""
    start, end = form_model_span(content_type, body)
    try:
        return body[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody("the form's model is not UTF-8") from None


def with_model(route: Route, content_type: str, body: bytes, model: str) -> bytes:
    """`body` naming `model` instead (an endpoint's public name rewritten to the deployment
    that serves it): a JSON body re-encoded, a form's one `model` value replaced in place."""
    if route.form:
        start, end = form_model_span(content_type, body)
        return body[:start] + model.encode() + body[end:]
    whole = _whole.decode(body)  # model_of read it already: valid JSON with a model
    whole["model"] = model
    return msgspec.json.encode(whole)


def form_model_span(content_type: str, body: bytes) -> tuple[int, int]:
    """Where the one `model` value of a form lies in `body` (`form_model`'s rules)."""
    boundary = _boundary(content_type)
    malformed = BadBody("malformed multipart/form-data body")
    delimiter = b"\r\n--" + boundary
    # The first delimiter opens the body, or follows a preamble (RFC 2046: ignored).
    if body.startswith(delimiter[2:]):
        pos = len(delimiter) - 2
    else:
        found = body.find(delimiter)
        if found < 0:
            raise malformed
        pos = found + len(delimiter)
    models: list[tuple[int, int]] = []  # where each `model` value lies in the body
    for _ in range(MAX_PARTS + 1):
        # After a delimiter: `--` closes the form; optional padding, then CRLF, a part.
        if body.startswith(b"--", pos):
            if len(models) != 1:
                raise BadBody(
                    "the form has no model field" if not models else "the form has two models"
                )
            start, end = models[0]
            if not 0 < end - start <= MAX_MODEL_NAME:
                raise BadBody("the form's model is empty or too long")
            return start, end
        while body.startswith((b" ", b"\t"), pos):
            pos += 1
        if not body.startswith(b"\r\n", pos):
            raise malformed
        pos += 2
        if body.startswith(b"\r\n", pos):
            head, start = b"", pos + 2  # a part without headers
        else:
            end_of_head = body.find(b"\r\n\r\n", pos, pos + MAX_PART_HEAD)
            if end_of_head < 0:
                raise malformed
            head, start = body[pos:end_of_head], end_of_head + 4
        end = body.find(delimiter, start)
        if end < 0:
            raise malformed  # a part never closed
        if _field_name(head) == "model":
            models.append((start, end))
        pos = end + len(delimiter)
    raise BadBody(f"the form has more than {MAX_PARTS} parts")


def model_object(served: list[dict[str, object]], model: str) -> dict[str, object] | None:
    """`GET /v1/models/{model}`: its entry of `/v1/models`, or None (OpenAI's 404)."""
    for entry in served:
        if entry["id"] == model:
            return entry
    return None
