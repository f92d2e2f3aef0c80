"""JSON from outside the agent (a client's body, a member's, an engine's answer), decoded
into its type or refused with one typed error: `decode_json` is the one place the agent
takes msgspec's `RecursionError` for what it is, bad input. Pure: msgspec only."""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec

__all__ = ["NESTED_TOO_DEEPLY", "BadJson", "decode_json"]

NESTED_TOO_DEEPLY: Final = "nested too deeply"

T = TypeVar("T")


class BadJson(ValueError):
    """What a peer sent is not JSON of the expected type: malformed, of the wrong types, or
    nested too deeply. The peer's fault; the message says what is wrong (msgspec's words)."""


def decode_json(decoder: msgspec.json.Decoder[T], data: bytes) -> T:
    """`data` decoded by `decoder`; `BadJson` when it cannot be."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # malformed, or of the wrong types (ValidationError)
        raise BadJson(str(exc)) from exc
    except RecursionError as exc:
        # msgspec gives up on JSON nested past Python's recursion limit (100,000 `[`, even
        # in a field it skips) with a RecursionError, not a DecodeError: bad input all the
        # same (a 400, not a 500).
        raise BadJson(NESTED_TOO_DEEPLY) from exc
