"""Answering JSON-RPC payloads from a method table, sans-I/O.

`Dispatcher.handle(payload)` parses one payload, calls the handler for each request and
notification, and returns the reply bytes (or `None` when the spec says to send nothing).
Handlers are plain synchronous callables that take the raw `params` and return a result or
raise `RpcError`; a `msgspec.ValidationError` from a handler's typed decode becomes -32602 and
any other exception -32603, logged without the payload. Nothing escapes `handle()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec
from msgspec import UNSET, Raw, UnsetType

from .jsonrpc import (
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
    Response,
    RpcError,
    encode_error,
    encode_result,
    parse_payload,
)

__all__ = ["Dispatcher", "Handler"]

log = logging.getLogger(__name__)

Handler = Callable[[Raw | UnsetType], Any]

_NOT_FOUND: Final = ErrorObject(code=METHOD_NOT_FOUND, message="Method not found")


class Dispatcher:
    """Routes requests and notifications to handlers and builds the spec's replies."""

    def __init__(
        self,
        methods: Mapping[str, Handler],
        *,
        on_response: Callable[[Response], None] | None = None,
    ) -> None:
        self.methods = methods
        self.on_response = on_response
        self.errors_sent = 0
        self.notification_errors = 0

    def handle(self, payload: bytes | memoryview) -> bytes | None:
        """Answer one payload (a message or a batch); `None` means send nothing."""
        return self.handle_parsed(parse_payload(payload))

    def handle_parsed(self, parsed: Parsed) -> bytes | None:
        """Answer an already parsed payload."""
        if isinstance(parsed, ParseFailure):
            self.errors_sent += 1
            return encode_error(None, parsed.error)
        if isinstance(parsed, Batch):
            replies = [r for r in map(self._handle_one, parsed.messages) if r is not None]
            # A batch of notifications gets nothing at all, never an empty array (spec §6).
            return b"[" + b",".join(replies) + b"]" if replies else None
        return self._handle_one(parsed)

    def _handle_one(self, message: Request | Notification | Response | Invalid) -> bytes | None:
        if isinstance(message, Notification):
            self._notify(message)
            return None
        if isinstance(message, Request):
            return self._call(message)
        if isinstance(message, Response):
            if self.on_response is not None:
                self.on_response(message)
            else:
                log.debug("dropping a response to id %r: no request is pending", message.id)
            return None
        self.errors_sent += 1
        return encode_error(message.id, message.error)

    def _call(self, request: Request) -> bytes:
        handler = self.methods.get(request.method)
        if handler is None:
            self.errors_sent += 1
            return encode_error(request.id, _NOT_FOUND)
        try:
            result = handler(request.params)
        except RpcError as exc:
            self.errors_sent += 1
            return encode_error(request.id, exc.to_object())
        except msgspec.ValidationError as exc:
            self.errors_sent += 1
            return encode_error(request.id, _bad_params(exc))
        except Exception:
            log.exception("handler for %s failed", _printable(request.method))
            self.errors_sent += 1
            return encode_error(request.id, RpcError(INTERNAL_ERROR).to_object())
        return encode_result(request.id, result)

    def _notify(self, notification: Notification) -> None:
        handler = self.methods.get(notification.method)
        if handler is None:
            # The spec forbids a reply; say so in the log so a misspelt method is noticed.
            self.notification_errors += 1
            log.warning(
                "ignoring notification of unknown method %s", _printable(notification.method)
            )
            return
        try:
            handler(notification.params)
        except RpcError as exc:
            self.notification_errors += 1
            log.warning("ignoring bad %s notification: %s", _printable(notification.method), exc)
        except msgspec.ValidationError as exc:
            self.notification_errors += 1
            log.warning(
                "ignoring %s notification with invalid params at %s",
                _printable(notification.method),
                _where(exc),
            )
        except Exception:
            self.notification_errors += 1
            log.exception("handler for %s failed", _printable(notification.method))


def _bad_params(exc: msgspec.ValidationError) -> ErrorObject:
    # msgspec names the path and the expected type, never the offending value.
    return ErrorObject(code=INVALID_PARAMS, message="Invalid params", data=str(exc))


def _where(exc: msgspec.ValidationError) -> str:
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
