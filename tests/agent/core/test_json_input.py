"""JSON from outside, in memory: whatever bytes come, `decode_json` answers the decoded value
or a `BadJson` -- never msgspec's RecursionError, which was a 500 at every API that met it --
and the management APIs turn a `BadJson` into their one-line 400."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from agent.apis.answers import MAX_REASON, decoded
from agent.core.json_input import NESTED_TOO_DEEPLY, BadJson, decode_json


class Cordon(msgspec.Struct, frozen=True):
    cordoned: bool


OBJECTS = msgspec.json.Decoder(dict[str, Any])
CORDONS = msgspec.json.Decoder(Cordon)


def test_good_json_is_decoded_into_its_type() -> None:
    assert decode_json(CORDONS, b'{"cordoned": true, "other": [1]}') == Cordon(cordoned=True)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "JSON is malformed"),
        (b'{"cordoned": "yes"}', "Expected `bool`, got `str`"),
        (b"[]", "Expected `object`, got `array`"),
        # Nested past the recursion limit, in a field msgspec skips, and at the top.
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, NESTED_TOO_DEEPLY),
        (b'{"cordoned": true, "x": ' + b"[" * 100_000, NESTED_TOO_DEEPLY),
    ],
)
def test_bad_json_is_a_bad_json_saying_why(body: bytes, reason: str) -> None:
    with pytest.raises(BadJson, match=reason):
        decode_json(CORDONS, body)


@given(st.binary(max_size=64) | st.builds(lambda n: b'{"a":' * n, st.integers(0, 100_000)))
def test_nothing_but_bad_json_escapes(body: bytes) -> None:
    with contextlib.suppress(BadJson):
        decode_json(OBJECTS, body)


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


def test_the_apis_answer_bad_json_with_one_line_saying_what_was_wrong() -> None:
    with pytest.raises(web.HTTPBadRequest) as nested:
        decoded(OBJECTS, b'{"a":' * 100_000, "bad event")
    assert nested.value.text == "bad event: nested too deeply\n"
    # A reason that echoes what the client sent (an unknown field's name) is cut short.
    with pytest.raises(web.HTTPBadRequest) as long_name:
        decoded(msgspec.json.Decoder(Strict), b'{"' + b"x" * 10_000 + b'": 1}')
    assert long_name.value.text is not None
    assert long_name.value.text.startswith("Object contains unknown field `xxx")
    assert len(long_name.value.text) == MAX_REASON + 1  # and its newline
