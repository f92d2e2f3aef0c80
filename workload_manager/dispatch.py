"""Answering JSON-RPC payloads from a method table, sans-I/O.

`Dispatcher.answer(payload)` parses one payload, calls the handler for each request and
notification, and returns a `Reply`: the bytes to answer with (or `None` when the spec says
to send nothing) and how many of the payload's messages were invalid. Handlers are plain
synchronous callables that take the raw `params` and return a result or raise `RpcError`; a
`msgspec.ValidationError` from a handler's typed decode becomes -32602 and any other
exception -32603, logged without the payload. Nothing escapes `answer()`.

A handler whose answer needs I/O (the broker's `workloads:snapshot` reads the Jobs store)
returns `Deferred(what)`: the dispatcher sends nothing for that request now and hands
`(request id, what)` to `on_deferred`; the caller answers later with `encode_result`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from msgspec import UNSET, Raw, UnsetType

from workload_manager.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    Batch,
    ErrorObject,
    Invalid,
    Notification,
    Parsed,
    ParseFailure,
    Request,
    RequestId,
    Response,
    RpcError,
    encode_error,
    encode_result,
    parse_payload,
)

__all__ = ["Deferred", "Dispatcher", "Handler", "Reply", "decode_params"]

log = logging.getLogger(__name__)

Handler = Callable[[Raw | UnsetType], Any]

_NOT_FOUND: Final = ErrorObject(code=METHOD_NOT_FOUND, message="Method not found")


@dataclass(frozen=True, slots=True)
class Reply:
    """What one payload gets back: the bytes to answer with (`None`: send nothing) and how
    many of its messages were invalid (answered with an error, or a notification ignored)."""

    body: bytes | None
    invalid: int = 0


NOTHING: Final = Reply(None, 0)


@dataclass(frozen=True, slots=True)
class Deferred:
    """A handler's result that is not ready yet: `what` goes to `on_deferred` with the
    request's id, and the caller sends the response itself."""

    what: Any


class Dispatcher:
    """Routes requests and notifications to handlers and builds the spec's replies."""

    def __init__(
        self,
        methods: Mapping[str, Handler],
        *,
        on_response: Callable[[Response], None] | None = None,
        on_deferred: Callable[[RequestId, Any], None] | None = None,
    ) -> None:
        self.methods = methods
        self.on_response = on_response
        self.on_deferred = on_deferred
        self.errors_sent = 0
        self.notification_errors = 0

    def handle(self, payload: bytes | memoryview) -> bytes | None:
        """Answer one payload (a message or a batch); `None` means send nothing."""
        return self.answer_parsed(parse_payload(payload)).body

    def answer(self, payload: bytes | memoryview) -> Reply:
        """Answer one payload and say how many of its messages were invalid."""
        return self.answer_parsed(parse_payload(payload))

    def handle_parsed(self, parsed: Parsed) -> bytes | None:
        """Answer an already parsed payload."""
        return self.answer_parsed(parsed).body

    def answer_parsed(self, parsed: Parsed) -> Reply:
        """Answer an already parsed payload, with the count of invalid messages."""
        if isinstance(parsed, ParseFailure):
            self.errors_sent += 1
            return Reply(encode_error(None, parsed.error), 1)
        if isinstance(parsed, Batch):
            replies: list[bytes] = []
            invalid = 0
            for message in parsed.messages:
                body, bad = self._handle_one(message)
                invalid += bad
                if body is not None:
                    replies.append(body)
            # A batch of notifications gets nothing at all, never an empty array (spec §6).
            return Reply(b"[" + b",".join(replies) + b"]" if replies else None, invalid)
        body, bad = self._handle_one(parsed)
        return Reply(body, int(bad)) if body is not None or bad else NOTHING

    def _handle_one(
        self, message: Request | Notification | Response | Invalid
    ) -> tuple[bytes | None, bool]:
        # The reply for one message, and whether the message was invalid.
        if isinstance(message, Notification):
            return None, not self._notify(message)
        if isinstance(message, Request):
            return self._call(message)
        if isinstance(message, Response):
            if self.on_response is not None:
                self.on_response(message)
            else:
                log.debug("dropping a response to id %r: no request is pending", message.id)
            return None, False
        self.errors_sent += 1
        return encode_error(message.id, message.error), True

    def _call(self, request: Request) -> tuple[bytes | None, bool]:
        handler = self.methods.get(request.method)
        if handler is None:
            self.errors_sent += 1
            return encode_error(request.id, _NOT_FOUND), True
        try:
            result = handler(request.params)
        except RpcError as exc:
            self.errors_sent += 1
            return encode_error(request.id, exc.to_object()), True
        except msgspec.DecodeError as exc:  # a ValidationError, or params not UTF-8
            self.errors_sent += 1
            return encode_error(request.id, _bad_params(exc)), True
        except Exception:
            log.exception("handler for %s failed", _printable(request.method))
            self.errors_sent += 1
            return encode_error(request.id, RpcError(INTERNAL_ERROR).to_object()), True
        if type(result) is Deferred:
            if self.on_deferred is None:
                log.error("handler for %s deferred with no one to answer", request.method[:64])
                self.errors_sent += 1
                return encode_error(request.id, RpcError(INTERNAL_ERROR).to_object()), True
            self.on_deferred(request.id, result.what)
            return None, False
        return encode_result(request.id, result), False

    def _notify(self, notification: Notification) -> bool:
        # Whether the notification was taken; the spec forbids any reply either way.
        handler = self.methods.get(notification.method)
        if handler is None:
            # The spec forbids a reply; say so in the log so a misspelt method is noticed.
            self.notification_errors += 1
            log.warning(
                "ignoring notification of unknown method %s", _printable(notification.method)
            )
            return False
        try:
            handler(notification.params)
        except RpcError as exc:
            self.notification_errors += 1
            log.warning("ignoring bad %s notification: %s", _printable(notification.method), exc)
        except msgspec.DecodeError as exc:  # a ValidationError, or params not UTF-8
            self.notification_errors += 1
            log.warning(
                "ignoring %s notification with invalid params at %s",
                _printable(notification.method),
                _where(exc),
            )
        except Exception:
            self.notification_errors += 1
            log.exception("handler for %s failed", _printable(notification.method))
        else:
            return True
        return False


def _bad_params(exc: msgspec.DecodeError) -> ErrorObject:
    # msgspec names the path and the expected type (or that the bytes are not UTF-8), never
    # the offending value. Params travel as raw JSON, undecoded until their handler runs, so
    # bytes that are not UTF-8 inside them are found only here.
    return ErrorObject(code=INVALID_PARAMS, message="Invalid params", data=str(exc))


def _where(exc: msgspec.DecodeError) -> str:
    # Log only where the params went wrong: the message may quote the offending value.
    _, sep, path = str(exc).rpartition(" - at ")
    return path if sep else "$"


def _printable(method: str) -> str:
    # A method name comes from the caller: keep log lines short and on one line.
    return repr(method[:64])


def decode_params(decoder: msgspec.json.Decoder[Any], params: Raw | UnsetType) -> Any:
    """Decode raw params with a typed decoder; missing params are an -32602 error."""
    if params is UNSET:
        raise RpcError(INVALID_PARAMS, "params are required")
    return decoder.decode(params)
