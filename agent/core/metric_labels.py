"""Bounded label values for `/metrics`: a client must not be able to grow the series count.

A model, deployment or key label takes only names the cluster knows -- a live deployment,
an engine's model, a configured key, a model some request was placed for -- and at most
`MAX_LABELS` distinct ones; anything else is `other`. A name the cluster no longer knows
gives its place up (`FirstSeen.retain`), so a cluster that renames its deployments over
months does not end up counting everything as `other`.
"""

from __future__ import annotations

from collections.abc import Collection, Container
from typing import Final

__all__ = ["MAX_LABELS", "OTHER", "FirstSeen", "bounded"]

MAX_LABELS: Final = 256
OTHER: Final = "other"


def bounded(name: str, known: Container[str]) -> str:
    """`name` when the cluster knows it, else `other`."""
    return name if name in known else OTHER


class FirstSeen:
    """At most `limit` distinct label values, the first ones seen; the rest are `other`.
    For values already known to the cluster (a placed job's model, an admitted key), so
    the bound only matters when the cluster itself has that many."""

    def __init__(self, limit: int = MAX_LABELS) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(value)
        return value

    def retain(self, keep: Container[str]) -> Collection[str]:
        """Forget every value not in `keep`, freeing its place; the values forgotten."""
        gone = {value for value in self._seen if value not in keep}
        self._seen -= gone
        return gone
