"""JSON from outside, in memory: whatever bytes come, `decode_json` answers the decoded value
or a `BadJson` -- never msgspec's RecursionError, which was a 500 at every API that met it."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
