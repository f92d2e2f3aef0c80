"""The wire of API keys' cluster-wide limits (issue 29, item 4): who holds a key's count, and
what members ask it (`POST /v1/limits/lease` on the node API; `agent.serving.cluster_limits`
is the member's side). Pure."""

from __future__ import annotations

import hashlib
from typing import Annotated, Final

import msgspec
from msgspec import Meta

__all__ = ["MAX_CHUNK", "MAX_KEYS", "KeyAsk", "KeyGrant", "LeaseAnswer", "LeaseAsk", "holder_of"]

MAX_CHUNK: Final = 64  # requests in one lease at most
MAX_KEYS: Final = 256  # keys in one call


class KeyAsk(msgspec.Struct, frozen=True):
    """One key in a lease call: requests wanted, tokens used here since the last report."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]
    want: Annotated[int, Meta(ge=0, le=MAX_CHUNK)] = 0
    tokens: Annotated[int, Meta(ge=0, le=2**40)] = 0


class LeaseAsk(msgspec.Struct, frozen=True):
    """`POST /v1/limits/lease` on the node API: what a member asks a keys' holder."""

    keys: Annotated[list[KeyAsk], Meta(max_length=MAX_KEYS)]


class KeyGrant(msgspec.Struct, frozen=True):
    """The holder's answer for one key: requests granted, the key's tokens in the last
    minute cluster-wide, when to ask again after a grant of none; `known`: false when the
    holder has no such key (it is not yet known there, or was revoked)."""

    name: str
    granted: int = 0
    tokens: int = 0
    retryAfter: int = 0
    known: bool = True


class LeaseAnswer(msgspec.Struct, frozen=True):
    """The answer of `POST /v1/limits/lease`."""

    keys: list[KeyGrant]


def holder_of(name: str, members: list[str]) -> str:
    """The member that holds key `name`'s count: first in its rendezvous order."""

    def weight(node_id: str) -> bytes:
        return hashlib.blake2b(f"{name}\x00{node_id}".encode(), digest_size=16).digest()

    return max(members, key=lambda n: (weight(n), n))
