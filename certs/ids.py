"""Wingsmith ids: a type prefix, `_` and a lowercase Crockford base32 ULID (seed 000, "IDs").

Node ids (`nod_…`) live here because a node mints its own; the plane's other kinds use the
same `prefixed_ulid`.
"""

from __future__ import annotations

import re
from typing import Final

from ulid import ULID

__all__ = [
    "DNS_SUFFIX",
    "NODE_ID_RE",
    "is_node_id",
    "new_node_id",
    "node_dns_name",
    "node_uri",
    "prefixed_ulid",
]

NODE_ID_RE: Final = re.compile(r"^nod_[0-9a-hjkmnp-tv-z]{26}$")
_URI_PREFIX: Final = "urn:nvpair:node:"
# A name under the private-use `.internal` domain that each node certificate carries, so a
# client checks "this is node X" with the ordinary hostname check while it connects by IP.
DNS_SUFFIX: Final = ".nvpair.internal"


def prefixed_ulid(prefix: str) -> str:
    """`prefix` + "_" + a fresh ULID in lowercase Crockford base32 (26 characters).

    Lowercase because seed 000 spells ids that way; ULIDs sort by creation time, so ids of
    one kind minted later sort later.
    """
    return f"{prefix}_{str(ULID()).lower()}"


def new_node_id() -> str:
    """A fresh node id."""
    return prefixed_ulid("nod")


def is_node_id(text: str) -> bool:
    """Whether `text` is a well-formed node id."""
    return NODE_ID_RE.match(text) is not None


def node_uri(node_id: str) -> str:
    """The SAN URI that carries the node id in its certificate."""
    return _URI_PREFIX + node_id


def node_id_from_uri(uri: str) -> str | None:
    """The node id in a SAN URI, or None if the URI is not ours."""
    if uri.startswith(_URI_PREFIX) and is_node_id(uri[len(_URI_PREFIX) :]):
        return uri[len(_URI_PREFIX) :]
    return None


def node_dns_name(node_id: str) -> str:
    """The DNS SAN a client checks when it expects to reach `node_id`."""
    return node_id + DNS_SUFFIX
