"""The management APIs' answer to bad JSON, in memory: one line of text naming what was wrong,
the reason cut short when it echoes what the client sent."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from aiohttp import web

from agent.apis.answers import MAX_REASON, decoded

OBJECTS = msgspec.json.Decoder(dict[str, Any])


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
