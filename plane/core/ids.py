"""Wingsmith ids: a type prefix and a lowercase Crockford base32 ULID (seed 000, "IDs").

Declared ids are minted by the plane; a cluster mints the ids of the nodes, devices and
topology domains it discovers.
"""

from __future__ import annotations

import re
from typing import Final

from certs.ids import prefixed_ulid
from plane.core.errors import InvalidId

__all__ = ["PREFIXES", "InvalidId", "is_id", "new_id", "validate_id"]

PREFIXES: Final = {
    "clu": "Cluster",
    "nod": "Node",
    "dev": "Device",
    "tpd": "TopologyDomain",
    "pol": "Pool",
    "art": "Artifact",
    "wkl": "Workload",
    "dep": "Deployment",
    "rep": "Replica",
    "grp": "Spanning replica",
    "end": "Endpoint",
    "ten": "Tenant",
    "prj": "Project",
    "qta": "Quota",
    "prc": "PriorityClass",
    "plc": "Policy",
    "alc": "Allocation",
    "opr": "Operation",
    "cmp": "Component",
    "evt": "Event",
}
_ID: Final = re.compile(r"^([a-z]{3})_([0-9a-hjkmnp-tv-z]{26})$")


def new_id(prefix: str) -> str:
    """A fresh id of kind `prefix` (`"clu"`, `"wkl"`, ...)."""
    if prefix not in PREFIXES:
        raise InvalidId(f"unknown id prefix {prefix!r}")
    return prefixed_ulid(prefix)


def is_id(text: str, prefix: str | None = None) -> bool:
    """Whether `text` is a well-formed id (of kind `prefix`, when given)."""
    match = _ID.match(text)
    if match is None:
        return False
    return match[1] in PREFIXES and (prefix is None or match[1] == prefix)


def validate_id(text: str, prefix: str) -> str:
    """`text` if it is an id of kind `prefix`, else `InvalidId` saying what is wrong."""
    if not is_id(text, prefix):
        raise InvalidId(
            f"{text[:64]!r} is not a {PREFIXES.get(prefix, prefix)} id "
            f"({prefix}_ followed by 26 lowercase Crockford base32 characters)"
        )
    return text
