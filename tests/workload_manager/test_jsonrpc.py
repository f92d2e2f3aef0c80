"""JSON-RPC 2.0: every example of the spec's examples section, and robustness.

The spec's examples are fed to a `Dispatcher` that has the spec's methods (subtract, sum,
get_data, notify_hello, update). Our error objects carry a `data` member with detail, which
the spec allows ("may be omitted"); the comparison leaves it out and checks all the rest.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec import UNSET

from workload_manager.dispatch import Dispatcher, decode_params
from workload_manager.errors import UsageError
from workload_manager.jsonrpc import (
    Batch,
    Invalid,
    Notification,
    ParseFailure,
    Request,
    Response,
    RpcError,
    encode_batch,
    notification,
    parse_payload,
    request,
)

notified: list[tuple[str, Any]] = []


def subtract(params: Any) -> int:
    value = decode_params(msgspec.json.Decoder(list[int] | dict[str, int]), params)
    if isinstance(value, list):
        return int(value[0] - value[1])
    return int(value["minuend"] - value["subtrahend"])


def spec_dispatcher() -> Dispatcher:
    ints = msgspec.json.Decoder(list[int])
    return Dispatcher(
        {
            "subtract": subtract,
            "sum": lambda params: sum(decode_params(ints, params)),
            "get_data": lambda params: ["hello", 5],
            "notify_hello": lambda params: notified.append(("notify_hello", params)),
            "notify_sum": lambda params: notified.append(("notify_sum", params)),
            "update": lambda params: notified.append(("update", params)),
        }
    )


def without_data(value: Any) -> Any:
    if isinstance(value, list):
        return [without_data(item) for item in value]
    if isinstance(value, dict) and "error" in value:
        error = {k: v for k, v in value["error"].items() if k != "data"}
        return {**value, "error": error}
    return value


def ask(payload: str) -> Any:
    reply = spec_dispatcher().handle(payload.encode())
    return None if reply is None else without_data(json.loads(reply))


PARSE_ERROR = {"jsonrpc": "2.0", "error": {"code": -32700, "message": "Parse error"}, "id": None}
INVALID = {"jsonrpc": "2.0", "error": {"code": -32600, "message": "Invalid Request"}, "id": None}

# (name, request exactly as the spec writes it, the spec's answer or None for no answer)
SPEC_EXAMPLES: list[tuple[str, str, Any]] = [
    (
        "positional 1",
        '{"jsonrpc": "2.0", "method": "subtract", "params": [42, 23], "id": 1}',
        {"jsonrpc": "2.0", "result": 19, "id": 1},
    ),
    (
        "positional 2",
        '{"jsonrpc": "2.0", "method": "subtract", "params": [23, 42], "id": 2}',
        {"jsonrpc": "2.0", "result": -19, "id": 2},
    ),
    (
        "named 1",
        '{"jsonrpc": "2.0", "method": "subtract", "params": {"subtrahend": 23, "minuend": 42},'
        ' "id": 3}',
        {"jsonrpc": "2.0", "result": 19, "id": 3},
    ),
    (
        "named 2",
        '{"jsonrpc": "2.0", "method": "subtract", "params": {"minuend": 42, "subtrahend": 23},'
        ' "id": 4}',
        {"jsonrpc": "2.0", "result": 19, "id": 4},
    ),
    (
        "notification 1",
        '{"jsonrpc": "2.0", "method": "update", "params": [1,2,3,4,5]}',
        None,
    ),
    ("notification 2", '{"jsonrpc": "2.0", "method": "foobar"}', None),
    (
        "non-existent method",
        '{"jsonrpc": "2.0", "method": "foobar", "id": "1"}',
        {"jsonrpc": "2.0", "error": {"code": -32601, "message": "Method not found"}, "id": "1"},
    ),
    (
        "invalid JSON",
        '{"jsonrpc": "2.0", "method": "foobar, "params": "bar", "baz]',
        PARSE_ERROR,
    ),
    (
        "invalid Request object",
        '{"jsonrpc": "2.0", "method": 1, "params": "bar"}',
        INVALID,
    ),
    (
        "batch, invalid JSON",
        '[\n  {"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"},\n'
        '  {"jsonrpc": "2.0", "method"\n]',
        PARSE_ERROR,
    ),
    ("empty Array", "[]", INVALID),
    ("invalid Batch but not empty", "[1]", [INVALID]),
    ("invalid Batch", "[1,2,3]", [INVALID, INVALID, INVALID]),
    (
        "batch",
        """[
        {"jsonrpc": "2.0", "method": "sum", "params": [1,2,4], "id": "1"},
        {"jsonrpc": "2.0", "method": "notify_hello", "params": [7]},
        {"jsonrpc": "2.0", "method": "subtract", "params": [42,23], "id": "2"},
        {"foo": "boo"},
        {"jsonrpc": "2.0", "method": "foo.get", "params": {"name": "myself"}, "id": "5"},
        {"jsonrpc": "2.0", "method": "get_data", "id": "9"}
    ]""",
        [
            {"jsonrpc": "2.0", "result": 7, "id": "1"},
            {"jsonrpc": "2.0", "result": 19, "id": "2"},
            INVALID,
            {"jsonrpc": "2.0", "error": {"code": -32601, "message": "Method not found"}, "id": "5"},
            {"jsonrpc": "2.0", "result": ["hello", 5], "id": "9"},
        ],
    ),
    (
        "batch, all notifications",
        """[
        {"jsonrpc": "2.0", "method": "notify_sum", "params": [1,2,4]},
        {"jsonrpc": "2.0", "method": "notify_hello", "params": [7]}
    ]""",
        None,
    ),
]


@pytest.mark.parametrize(("name", "request_text", "answer"), SPEC_EXAMPLES, ids=lambda x: x)
def test_spec_example(name: str, request_text: str, answer: Any) -> None:
    assert ask(request_text) == answer


def test_spec_examples_are_all_here() -> None:
    # The spec's section 7 has 15 examples; a missing one would be a silent gap.
    assert len(SPEC_EXAMPLES) == 15


def test_notifications_reach_their_handlers() -> None:
    notified.clear()
    ask('[{"jsonrpc":"2.0","method":"notify_hello","params":[7]}]')
    ask('{"jsonrpc":"2.0","method":"update","params":[1,2]}')
    assert [name for name, _ in notified] == ["notify_hello", "update"]


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        ('{"jsonrpc":"1.0","method":"x","id":1}', '"jsonrpc" must be "2.0"'),
        ('{"method":"x","id":1}', '"jsonrpc" must be "2.0"'),
        ('{"jsonrpc":"2.0","method":"x","params":"s","id":1}', '"params" must be an array'),
        ('{"jsonrpc":"2.0","method":"x","params":3,"id":1}', '"params" must be an array'),
        ('{"jsonrpc":"2.0","method":"x","id":1.5}', '"id" must be a string'),
        ('{"jsonrpc":"2.0","method":"x","id":true}', '"id" must be a string'),
        ('{"jsonrpc":"2.0","method":"x","id":[1]}', '"id" must be a string'),
        ('{"jsonrpc":2,"method":"x","id":1}', '"jsonrpc" must be "2.0"'),
        ('"hello"', "expected an object, got a string"),
        ("null", "expected an object, got null"),
        ('{"jsonrpc":"2.0","id":1}', "exactly one of result and error"),
        ('{"jsonrpc":"2.0","result":1,"error":{"code":1,"message":"m"},"id":1}', "exactly one"),
        ('{"jsonrpc":"2.0","error":"bad","id":1}', '"error" must be an object'),
    ],
)
def test_invalid_requests_say_what_is_wrong(payload: str, detail: str) -> None:
    reply = json.loads(spec_dispatcher().handle(payload.encode()) or b"null")
    assert reply["error"]["code"] == -32600
    assert detail in reply["error"]["data"]


def test_invalid_request_keeps_a_usable_id() -> None:
    reply = json.loads(spec_dispatcher().handle(b'{"jsonrpc":"2.0","method":1,"id":7}') or b"")
    assert reply["id"] == 7
    assert reply["error"]["code"] == -32600


def test_bad_params_are_32602_with_detail() -> None:
    reply = json.loads(
        spec_dispatcher().handle(b'{"jsonrpc":"2.0","method":"sum","params":["a"],"id":1}') or b""
    )
    assert reply["error"]["code"] == -32602
    assert reply["error"]["message"] == "Invalid params"
    assert "Expected `int`" in reply["error"]["data"]


def test_missing_params_are_32602() -> None:
    reply = json.loads(spec_dispatcher().handle(b'{"jsonrpc":"2.0","method":"sum","id":1}') or b"")
    assert reply["error"]["code"] == -32602


def test_handler_crash_is_32603_and_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def boom(params: Any) -> None:
        raise ZeroDivisionError

    dispatcher = Dispatcher({"boom": boom})
    reply = json.loads(dispatcher.handle(b'{"jsonrpc":"2.0","method":"boom","id":1}') or b"")
    assert reply["error"] == {"code": -32603, "message": "Internal error"}
    assert dispatcher.handle(b'{"jsonrpc":"2.0","method":"boom"}') is None
    assert dispatcher.notification_errors == 1


def test_rpc_error_from_handler_is_passed_on() -> None:
    def refuse(params: Any) -> None:
        raise RpcError(-32001, "try later", message="Busy")

    reply = json.loads(
        Dispatcher({"r": refuse}).handle(b'{"jsonrpc":"2.0","method":"r","id":1}') or b""
    )
    assert reply["error"] == {"code": -32001, "message": "Busy", "data": "try later"}


def test_responses_go_to_on_response() -> None:
    seen: list[Response] = []
    dispatcher = Dispatcher({}, on_response=seen.append)
    assert dispatcher.handle(b'{"jsonrpc":"2.0","result":{"a":1},"id":"q1"}') is None
    assert dispatcher.handle(b'{"jsonrpc":"2.0","error":{"code":-1,"message":"m"},"id":2}') is None
    assert [r.id for r in seen] == ["q1", 2]
    assert isinstance(seen[0].result, msgspec.Raw)
    assert json.loads(bytes(seen[0].result)) == {"a": 1}
    assert seen[1].error is not msgspec.UNSET


def test_parse_payload_kinds() -> None:
    assert isinstance(parse_payload(b'{"jsonrpc":"2.0","method":"m","id":null}'), Request)
    assert isinstance(parse_payload(b'{"jsonrpc":"2.0","method":"m"}'), Notification)
    assert isinstance(parse_payload(b'{"jsonrpc":"2.0","result":null,"id":1}'), Response)
    assert isinstance(parse_payload(b"[1]"), Batch)
    assert isinstance(parse_payload(b"{"), ParseFailure)
    assert isinstance(parse_payload(b"{}"), Invalid)


def test_null_id_request_gets_a_response() -> None:
    reply = spec_dispatcher().handle(b'{"jsonrpc":"2.0","method":"get_data","id":null}')
    assert json.loads(reply or b"") == {"jsonrpc": "2.0", "result": ["hello", 5], "id": None}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["jsonrpc", "method", "params", "id", "result", "error", "x"])
            | st.text(),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@given(st.binary(max_size=300))
def test_nothing_but_a_reply_escapes_for_arbitrary_bytes(payload: bytes) -> None:
    reply = spec_dispatcher().handle(payload)
    assert reply is None or isinstance(json.loads(reply), dict | list)


@given(json_values)
def test_nothing_but_a_reply_escapes_for_arbitrary_json(value: Any) -> None:
    reply = spec_dispatcher().handle(json.dumps(value).encode())
    if reply is not None:
        decoded = json.loads(reply)
        for item in decoded if isinstance(decoded, list) else [decoded]:
            assert item["jsonrpc"] == "2.0"
            assert "id" in item
            assert ("result" in item) != ("error" in item)


def test_deeply_nested_json_is_a_clean_error() -> None:
    reply = json.loads(spec_dispatcher().handle(b"[" * 100_000) or b"")
    assert reply["error"]["code"] == -32700


def test_a_batch_of_calls_is_one_encode_that_parses_back() -> None:
    body = encode_batch([notification("n", {"a": 1}), request("r", UNSET, "x")])
    parsed = parse_payload(body)
    assert isinstance(parsed, Batch)
    first, second = parsed.messages
    assert isinstance(first, Notification)
    assert (first.method, msgspec.json.decode(first.params or b"")) == ("n", {"a": 1})
    assert isinstance(second, Request)
    assert (second.method, second.params, second.id) == ("r", UNSET, "x")
    with pytest.raises(UsageError):
        encode_batch([])  # `[]` is invalid on the wire: refuse to build it
