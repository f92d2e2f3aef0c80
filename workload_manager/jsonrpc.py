"""JSON-RPC 2.0 messages, sans-I/O: bytes in, typed messages out, and back.

`parse_payload()` turns one payload (a single message or a batch array) into typed messages;
it never raises. Every element the spec calls invalid becomes an `Invalid` carrying the error
object to answer with, so the caller only decides what to reply. The fast path decodes the
envelope straight into a `msgspec.Struct`, keeping `params` and `result` as raw JSON for the
method's own typed decoder; anything that does not fit falls back to a slow, exact
classification that names what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec
from msgspec import UNSET, Raw, Struct, UnsetType

from workload_manager.errors import UsageError

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "Batch",
    "Call",
    "ErrorObject",
    "Invalid",
    "Message",
    "Notification",
    "ParseFailure",
    "Parsed",
    "Request",
    "RequestId",
    "Response",
    "RpcError",
    "encode_batch",
    "encode_error",
    "encode_message",
    "encode_notification",
    "encode_request",
    "encode_result",
    "notification",
    "parse_payload",
    "request",
]

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603

# The spec's own messages; detail goes into `data`, which the spec leaves to the server.
STANDARD_MESSAGES: Final = {
    PARSE_ERROR: "Parse error",
    INVALID_REQUEST: "Invalid Request",
    METHOD_NOT_FOUND: "Method not found",
    INVALID_PARAMS: "Invalid params",
    INTERNAL_ERROR: "Internal error",
}

RequestId = str | int | None


class ErrorObject(Struct, kw_only=True, frozen=True):
    """The `error` member of a response."""

    code: int
    message: str
    data: Any = UNSET


class RpcError(Exception):
    """A handler's refusal, answered to the caller as a JSON-RPC error object."""

    def __init__(self, code: int, data: str | None = None, *, message: str | None = None) -> None:
        self.code = code
        self.message = message or STANDARD_MESSAGES.get(code, "Server error")
        self.data = data
        super().__init__(f"{code} {self.message}" + (f": {data}" if data else ""))

    def to_object(self) -> ErrorObject:
        """The error object to put on the wire."""
        return ErrorObject(code=self.code, message=self.message, data=self.data or UNSET)


@dataclass(frozen=True, slots=True)
class Request:
    """A call that wants a response."""

    method: str
    params: Raw | UnsetType
    id: RequestId


@dataclass(frozen=True, slots=True)
class Notification:
    """A call without an id: the spec forbids any reply to it."""

    method: str
    params: Raw | UnsetType


@dataclass(frozen=True, slots=True)
class Response:
    """A response to one of our own requests: exactly one of `result` / `error`."""

    id: RequestId
    result: Raw | UnsetType
    error: ErrorObject | UnsetType


@dataclass(frozen=True, slots=True)
class Invalid:
    """An element the spec calls invalid; answer it with `error` and `id`."""

    error: ErrorObject
    id: RequestId


Message = Request | Notification | Response | Invalid


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch array: its elements in order (never empty; `[]` is a `ParseFailure`)."""

    messages: list[Message]


@dataclass(frozen=True, slots=True)
class ParseFailure:
    """The whole payload is unusable; answer with this one error object (id null)."""

    error: ErrorObject


Parsed = Message | Batch | ParseFailure


class _Envelope(Struct):
    # Every member optional: the classification below decides what the object is.
    jsonrpc: str | UnsetType = UNSET
    method: str | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    id: str | int | UnsetType | None = UNSET
    result: Raw | UnsetType = UNSET
    error: ErrorObject | UnsetType = UNSET


_fast_decoder: Final = msgspec.json.Decoder(_Envelope | list[Raw])
_element_decoder: Final = msgspec.json.Decoder(_Envelope)
_any_decoder: Final = msgspec.json.Decoder()
_encoder: Final = msgspec.json.Encoder()


def _invalid(detail: str, request_id: RequestId = None) -> Invalid:
    return Invalid(
        error=ErrorObject(code=INVALID_REQUEST, message="Invalid Request", data=detail),
        id=request_id,
    )


def parse_payload(payload: bytes | memoryview) -> Parsed:
    """Classify one payload; never raises, whatever the bytes."""
    try:
        try:
            decoded = _fast_decoder.decode(payload)
        except msgspec.ValidationError:
            # msgspec validates while it parses, so the rest may still be malformed JSON.
            return _classify_any(_any_decoder.decode(payload))
        if isinstance(decoded, list):
            if not decoded:
                return ParseFailure(
                    ErrorObject(code=INVALID_REQUEST, message="Invalid Request", data="empty batch")
                )
            return Batch([_parse_element(raw) for raw in decoded])
        return _classify(decoded)
    except msgspec.DecodeError as exc:
        return ParseFailure(ErrorObject(code=PARSE_ERROR, message="Parse error", data=str(exc)))
    except RecursionError:
        return ParseFailure(
            ErrorObject(code=PARSE_ERROR, message="Parse error", data="JSON is nested too deeply")
        )


def _parse_element(raw: Raw) -> Message:
    # The batch parsed as a whole, so every element is well-formed JSON.
    try:
        return _classify(_element_decoder.decode(raw))
    except msgspec.ValidationError:
        return _classify_any(_any_decoder.decode(raw))


def _params_ok(params: Raw | UnsetType) -> bool:
    if params is UNSET:
        return True
    # A Raw value spans exactly the JSON value, so its first byte says what it is.
    first = bytes(memoryview(params)[:1])
    return first in (b"[", b"{")


def _classify(env: _Envelope) -> Message:
    if env.jsonrpc != "2.0":
        return _invalid('"jsonrpc" must be "2.0"', _id_or_null(env.id))
    if env.method is not UNSET:
        if env.result is not UNSET or env.error is not UNSET:
            return _invalid("a request carries no result or error", _id_or_null(env.id))
        if not _params_ok(env.params):
            return _invalid('"params" must be an array or an object', _id_or_null(env.id))
        if env.id is UNSET:
            return Notification(method=env.method, params=env.params)
        return Request(method=env.method, params=env.params, id=env.id)
    if env.params is not UNSET:
        return _invalid('"method" is missing', _id_or_null(env.id))
    if (env.result is UNSET) == (env.error is UNSET):
        return _invalid("a response carries exactly one of result and error", _id_or_null(env.id))
    if env.id is UNSET:
        return _invalid('a response carries an "id"')
    return Response(id=env.id, result=env.result, error=env.error)


def _id_or_null(value: RequestId | UnsetType) -> RequestId:
    return None if value is UNSET else value


def _classify_any(value: Any) -> Message:
    # Slow path for anything the typed envelope refused: say exactly what is wrong.
    if not isinstance(value, dict):
        return _invalid(f"expected an object, got {_json_type(value)}")
    raw_id = value.get("id")
    request_id = raw_id if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else None
    if "id" in value and raw_id is not None and request_id is None:
        return _invalid('"id" must be a string, an integer or null')
    if "jsonrpc" in value and not isinstance(value["jsonrpc"], str):
        return _invalid('"jsonrpc" must be "2.0"', request_id)
    if "method" in value and not isinstance(value["method"], str):
        return _invalid('"method" must be a string', request_id)
    if "error" in value:
        return _invalid('"error" must be an object with an integer "code" and a string "message"')
    return _invalid("malformed message", request_id)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"


class Call(Struct, omit_defaults=False, gc=False):
    """An outgoing request or notification, built by `notification()` / `request()` to be
    encoded with others in one batch (`encode_batch`)."""

    jsonrpc: str
    method: str
    params: Any = UNSET
    id: str | int | UnsetType | None = UNSET


class _OutResult(Struct):
    jsonrpc: str
    result: Any
    id: str | int | None


class _OutError(Struct):
    jsonrpc: str
    error: ErrorObject
    id: str | int | None


def encode_notification(method: str, params: Any = UNSET) -> bytes:
    """One notification frame (no trailing newline)."""
    return _encoder.encode(notification(method, params))


def encode_request(method: str, params: Any, request_id: str | int) -> bytes:
    """One request frame (no trailing newline)."""
    return _encoder.encode(request(method, params, request_id))


def notification(method: str, params: Any = UNSET) -> Call:
    """A notification, for `encode_batch`."""
    return Call(jsonrpc="2.0", method=method, params=params)


def request(method: str, params: Any, request_id: str | int) -> Call:
    """A request, for `encode_batch`."""
    return Call(jsonrpc="2.0", method=method, params=params, id=request_id)


def encode_batch(calls: list[Call]) -> bytes:
    """One batch array of calls in a single encode (never empty: the spec refuses `[]`)."""
    if not calls:
        raise UsageError("a batch holds at least one call")
    return _encoder.encode(calls)


def encode_result(request_id: RequestId, result: Any) -> bytes:
    """A success response frame."""
    return _encoder.encode(_OutResult(jsonrpc="2.0", result=result, id=request_id))


def encode_error(request_id: RequestId, error: ErrorObject) -> bytes:
    """An error response frame."""
    return _encoder.encode(_OutError(jsonrpc="2.0", error=error, id=request_id))


def encode_message(message: Any) -> bytes:
    """Encode any msgspec-encodable value with the shared encoder."""
    return _encoder.encode(message)
