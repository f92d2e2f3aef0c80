"""The dispatcher's reply object: what to send, how many messages were invalid, and
requests whose answer comes later (Deferred)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from msgspec import Raw, UnsetType

from workload_manager.dispatch import Deferred, Dispatcher, Reply
from workload_manager.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, RequestId


def echo(params: Raw | UnsetType) -> Any:
    return json.loads(bytes(params)) if isinstance(params, Raw) else None


def later(params: Raw | UnsetType) -> Deferred:
    return Deferred("the store's page")


def test_a_valid_payload_counts_nothing_invalid() -> None:
    dispatcher = Dispatcher({"echo": echo})
    assert dispatcher.answer(b'{"jsonrpc":"2.0","method":"echo","params":[1]}') == Reply(None, 0)
    reply = dispatcher.answer(b'{"jsonrpc":"2.0","method":"echo","params":[1],"id":1}')
    assert reply.invalid == 0
    assert json.loads(reply.body or b"") == {"jsonrpc": "2.0", "result": [1], "id": 1}


def test_invalid_messages_are_counted_per_payload_notifications_included() -> None:
    dispatcher = Dispatcher({"echo": echo})
    batch = [
        {"jsonrpc": "2.0", "method": "echo", "params": [1]},  # fine
        {"jsonrpc": "2.0", "method": "nope", "params": []},  # unknown notification: no reply
        {"jsonrpc": "2.0", "method": "nope", "id": 2},  # unknown request: -32601
        {"jsonrpc": "1.0", "method": "echo", "id": 3},  # invalid request
        {"jsonrpc": "2.0", "method": "echo", "params": [2], "id": 4},  # fine
    ]
    reply = dispatcher.answer(json.dumps(batch).encode())
    assert reply.invalid == 3
    answers = {item["id"]: item for item in json.loads(reply.body or b"")}
    assert answers[2]["error"]["code"] == METHOD_NOT_FOUND
    assert answers[4]["result"] == [2]
    # The next payload starts from nothing: the count is the payload's, not a running total.
    assert dispatcher.answer(json.dumps(batch[0]).encode()) == Reply(None, 0)
    assert dispatcher.answer(b"not json").invalid == 1


def test_a_deferred_request_is_handed_on_and_answered_later() -> None:
    deferred: list[tuple[RequestId, Any]] = []
    dispatcher = Dispatcher(
        {"later": later, "echo": echo}, on_deferred=lambda i, what: deferred.append((i, what))
    )
    batch = [
        {"jsonrpc": "2.0", "method": "later", "id": "a"},
        {"jsonrpc": "2.0", "method": "echo", "params": [5], "id": "b"},
    ]
    reply = dispatcher.answer(json.dumps(batch).encode())
    assert reply.invalid == 0
    assert [item["id"] for item in json.loads(reply.body or b"")] == ["b"]  # only what is ready
    assert deferred == [("a", "the store's page")]
    # As a notification it asks for nothing, so nothing is deferred.
    assert dispatcher.answer(b'{"jsonrpc":"2.0","method":"later"}') == Reply(None, 0)
    assert len(deferred) == 1


def test_deferring_with_no_one_to_answer_is_an_internal_error() -> None:
    reply = Dispatcher({"later": later}).answer(b'{"jsonrpc":"2.0","method":"later","id":1}')
    assert reply.invalid == 1
    assert json.loads(reply.body or b"")["error"]["code"] == INTERNAL_ERROR


def test_params_that_are_not_utf8_are_invalid_params_not_an_internal_error() -> None:
    # Params stay raw JSON until their handler decodes them, so bytes that are not UTF-8
    # inside them surface there as a DecodeError: that was answered -32603 (and logged as
    # a failed handler); it is the sender's fault, -32602.
    def decode(params: Raw | UnsetType) -> Any:
        return msgspec.json.decode(params, type=dict[str, str]) if isinstance(params, Raw) else None

    dispatcher = Dispatcher({"decode": decode})
    reply = dispatcher.answer(b'{"jsonrpc":"2.0","method":"decode","params":{"a":"\xff"},"id":1}')
    assert json.loads(reply.body or b"")["error"]["code"] == INVALID_PARAMS
    notice = dispatcher.answer(b'{"jsonrpc":"2.0","method":"decode","params":{"a":"\xc0\x80"}}')
    assert (notice.invalid, dispatcher.notification_errors) == (1, 1)
