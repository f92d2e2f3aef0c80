"""Which release a member runs and which wire versions it speaks; what members of two
releases do together. Sans-I/O (docs/upgrade.md is the policy in words).

A **wire version** numbers what members say to each other (records and their deltas, signed
facts, the node API's routes and bodies). A release speaks a range of them: this one and
the one before, so members one release apart work together while an owner upgrades one
machine at a time. Wire 1 is every release before 0.2.0: a member that sends no `Speaks`
statement speaks wire 1 alone.

Each member signs a `Speaks` statement about itself (its release, its range, when it said
so) with its own key, as it signs its record: members relay it and check it against the
owner's pinned certificate. From the statements every member derives the same **cluster
wire version**: the highest version every member speaks (the lowest of their maxima). A
feature that every member must understand (`FEATURES`) is on only once the cluster wire
version reaches the one that brought it -- after the last member is upgraded, never before.

Two members whose ranges do not overlap (two releases apart) do not work together: each
refuses the other's calls with a message that names both releases (`refusal`), and a
member takes nothing such a member signed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Final

from msgspec import Meta, Struct

from workload_manager._version import VERSION

__all__ = [
    "FEATURES",
    "LEGACY",
    "RELEASE",
    "WIRE_MAX",
    "WIRE_MIN",
    "Gate",
    "Range",
    "Speaks",
    "cluster_wire",
    "describe",
    "gate",
    "of",
    "parse_range",
    "refusal",
]

RELEASE: Final = VERSION  # this release (pyproject.toml's version)
WIRE_MIN: Final = 1  # the oldest wire version this release speaks (0.1.0's)
WIRE_MAX: Final = 2  # the newest: this release's

# What needs every member to speak a wire version before it is used: feature -> version.
# `signed-facts-kept` is this release's own: every member keeps and relays the fields of a
# signed fact it does not know, byte for byte, so a release after this one may add fields
# to records, deployments and keys once no member of 0.1.0 is left.
# `artifacts`: weights as cluster facts, fetched from the members that hold them (issue 28):
# a member of 0.1.0 neither keeps them nor serves them, so they wait for every member.
# `elastic-deployments`: a deployment may carry bounds (`facts.deployments.Elastic`); a
# member of 0.1.0 refuses a deployment with a field it does not know (issue 30).
# `spanning-replicas`: a deployment's replica may span members (`nodes`), and a record's
# replica names its group and layout (issue 32).
FEATURES: Final[Mapping[str, int]] = {
    "signed-facts-kept": 2,
    "artifacts": 2,
    "cluster-key-limits": 2,
    "elastic-deployments": 2,
    "spanning-replicas": 2,
}

_Text = Annotated[str, Meta(max_length=64)]
_Version = Annotated[int, Meta(ge=1, le=65535)]


class Speaks(Struct, kw_only=True, frozen=True):
    """What a member says about its own release: signed by it (`facts.record_signing`)."""

    nodeId: Annotated[str, Meta(min_length=1, max_length=256)]
    release: _Text  # e.g. 0.2.0
    wireMin: _Version
    wireMax: _Version
    at: Annotated[int, Meta(ge=0)]  # epoch ms it said so; a later statement wins
    signature: Annotated[str, Meta(max_length=256)] = ""


@dataclass(frozen=True, slots=True)
class Range:
    """A member's release and the wire versions it speaks."""

    release: str
    low: int
    high: int

    def overlaps(self, other: Range) -> bool:
        """Whether the two share a wire version."""
        return self.low <= other.high and other.low <= self.high


LEGACY: Final = Range("0.1.0 or older", 1, 1)  # a member that sends no statement


def of(statement: Speaks | None, record_release: str | None = None) -> Range:
    """The range a member speaks, from its statement: none, or one that names another
    release than its record (`record_release`, the record's `version`: it was rolled back
    to a release that sends no statement, so the one held is stale), is wire 1 alone."""
    if statement is None or record_release not in (None, statement.release):
        return LEGACY
    return Range(statement.release, statement.wireMin, statement.wireMax)


def parse_range(text: str) -> Range:
    """`0.3.0:2-3` (a release and its wire range) as a `Range`; ValueError otherwise."""
    release, _, versions = text.partition(":")
    low, _, high = versions.partition("-")
    try:
        speaks = Range(release, int(low), int(high or low))
    except ValueError:
        raise ValueError(f"not RELEASE:LOW-HIGH (like 0.3.0:2-3): {text!r}") from None
    if not release or not 1 <= speaks.low <= speaks.high:
        raise ValueError(f"not RELEASE:LOW-HIGH (like 0.3.0:2-3): {text!r}")
    return speaks


def describe(speaks: Range) -> str:
    """`nvpair 0.2.0 (wire 1-2)`."""
    wire = str(speaks.low) if speaks.low == speaks.high else f"{speaks.low}-{speaks.high}"
    return f"nvpair {speaks.release} (wire {wire})"


def refusal(mine: Range, theirs: Range, *, who: str) -> str | None:
    """Why this member and `who` (running `theirs`) cannot work together, naming both
    releases; None when their ranges overlap."""
    if mine.overlaps(theirs):
        return None
    older, newer = (theirs, mine) if theirs.high < mine.low else (mine, theirs)
    return (
        f"{who} runs {describe(theirs)} and this member runs {describe(mine)}: they share no "
        f"wire version (members at most one release apart work together); upgrade the "
        f"member on {older.release} to a release that speaks wire {newer.low} first "
        "(docs/upgrade.md)"
    )


def cluster_wire(ranges: Iterable[Range]) -> int:
    """The highest wire version every member speaks: the lowest of their maxima (members
    whose ranges do not overlap are refused, not counted: see `refusal`)."""
    return min((r.high for r in ranges), default=WIRE_MAX)


def _first(pair: tuple[str, Range]) -> str:
    return pair[0]


@dataclass(frozen=True, slots=True)
class Gate:
    """The cluster wire version and which features it turns on; who holds the rest back."""

    wire: int
    on: tuple[str, ...]
    off: tuple[str, ...]
    held_back_by: tuple[tuple[str, Range], ...]  # (node id, range) below the newest version

    def allows(self, feature: str) -> bool:
        """Whether `feature` may be used: every member speaks the version that brought it."""
        return feature in self.on


def gate(
    ranges: Mapping[str, Range], features: Mapping[str, int] = FEATURES, *, mine: Range
) -> Gate:
    """The gate of a cluster whose members (node id -> range, this member included) speak
    `ranges`; members whose range does not overlap `mine` are left out (they are refused)."""
    counted = {n: r for n, r in ranges.items() if r.overlaps(mine)}
    wire = min(cluster_wire(counted.values()), mine.high)
    on = tuple(sorted(f for f, v in features.items() if v <= wire))
    off = tuple(sorted(f for f, v in features.items() if v > wire))
    behind = tuple(sorted(((n, r) for n, r in counted.items() if r.high < mine.high), key=_first))
    return Gate(wire, on, off, behind)
