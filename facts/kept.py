"""A signed fact as this member holds it: what it understood of it and the bytes it was
signed as. Sans-I/O.

Members of two releases work side by side (docs/upgrade.md): a record or fact signed by a
later release may carry fields this one does not know. It is decoded for what this release
understands (`fact`) and kept, relayed and saved as the bytes it came in (`raw`), so its
signature still verifies on every member and nothing it says is dropped or rewritten.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import msgspec

__all__ = ["Kept", "raws"]

T = TypeVar("T")

_encode: Final = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Kept(Generic[T]):
    """`fact` as understood here, and `raw`, the bytes it was signed as."""

    fact: T
    raw: bytes

    @classmethod
    def made(cls, fact: T) -> Kept[T]:
        """A fact made (or first read) here: this release's encoding is its bytes."""
        return cls(fact, _encode(fact))


def raws(facts: Iterable[object]) -> list[msgspec.Raw]:
    """`facts` as the pieces of a message: kept ones as their bytes, others encoded."""
    return [msgspec.Raw(f.raw) if isinstance(f, Kept) else msgspec.Raw(_encode(f)) for f in facts]
