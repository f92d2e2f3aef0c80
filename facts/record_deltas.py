"""What two members' holdings differ by, sans-I/O: the digest their pings compare and the
version vectors a records exchange carries.

A member's holdings are one entry per node id: the generation of the record it holds,
`PINNED` for a pinned member whose record it has not got, `REMOVED` for a tombstone. The
digest hashes the sorted entries and the signed statements (deployments, API keys) by
version, so two members that hold the same agree on it whatever the order they learnt in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Final

from facts.api_keys import ApiKey
from facts.artifacts import Artifact
from facts.deployments import Deployment
from facts.records import NodeRecord, Removal

__all__ = ["PINNED", "REMOVED", "digest", "holdings", "lacking"]

PINNED: Final = 0
REMOVED: Final = -1


def holdings(
    records: Iterable[NodeRecord], pinned: Iterable[str], removals: Iterable[Removal]
) -> dict[str, int]:
    """Node id -> generation held, `PINNED` or `REMOVED`."""
    held = dict.fromkeys(pinned, PINNED)
    for record in records:
        held[record.nodeId] = record.generation
    for removal in removals:
        held[removal.nodeId] = REMOVED
    return held


def digest(
    held: Mapping[str, int],
    deployments: Iterable[Deployment] = (),
    api_keys: Iterable[ApiKey] = (),
    artifacts: Iterable[Artifact] = (),
) -> str:
    """A short hash of the holdings and statements; equal holdings, equal digest."""
    h = hashlib.sha256()
    for node_id, generation in sorted(held.items()):
        h.update(f"n {node_id} {generation}\n".encode())
    for d in sorted(deployments, key=lambda d: d.name):
        h.update(f"d {d.name} {d.version} {d.updatedAt} {d.by}\n".encode())
    for k in sorted(api_keys, key=lambda k: k.name):
        h.update(f"k {k.name} {k.version} {k.updatedAt} {k.by}\n".encode())
    for a in sorted(artifacts, key=lambda a: a.name):
        h.update(f"a {a.name} {a.version} {a.updatedAt} {a.by}\n".encode())
    return h.hexdigest()[:24]


def lacking(
    mine: Mapping[str, int], theirs: Mapping[str, int]
) -> tuple[set[str], set[str], set[str]]:
    """What a member holding `theirs` lacks of `mine`: (ids whose record we hold newer,
    ids it does not know at all -- their certificates, ids we hold a tombstone of and it
    does not). A tombstone there wins over anything of ours."""
    newer: set[str] = set()
    unknown: set[str] = set()
    removed: set[str] = set()
    for node_id, generation in mine.items():
        there = theirs.get(node_id)
        if there == REMOVED:
            continue
        if generation == REMOVED:
            removed.add(node_id)
            continue
        if there is None:
            unknown.add(node_id)
        if generation > (there or PINNED):
            newer.add(node_id)
    return newer, unknown, removed
