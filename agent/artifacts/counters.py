"""What this member's artifact transfers did, for `/metrics` (issue 28): bytes fetched from
and served to each member, pieces verified and refused (by the member that sent them), and
how long whole fetches took. Counts only: never a path or a byte of the weights. Members are
labelled by node id (at most the cluster's members: a bounded set)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

__all__ = ["FETCH_BUCKETS", "ArtifactCounters"]

# Seconds: a small artifact on a LAN takes about one, a 100 GB model minutes to an hour.
FETCH_BUCKETS: Final = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass
class ArtifactCounters:
    """Cumulative since the agent started."""

    bytes_fetched: Counter[str] = field(default_factory=Counter)  # member -> bytes kept
    bytes_served: Counter[str] = field(default_factory=Counter)  # member -> bytes sent
    pieces_verified: int = 0
    pieces_refused: Counter[str] = field(default_factory=Counter)  # member -> bad pieces
    fetches: Counter[str] = field(default_factory=Counter)  # outcome -> fetches ended so
    # Whole fetches' durations: a count per bucket of FETCH_BUCKETS (the last: longer), sum.
    duration_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS) + 1))
    duration_sum: float = 0.0

    def fetched(self, member: str, size: int) -> None:
        """A verified piece of `size` bytes from `member`."""
        self.pieces_verified += 1
        self.bytes_fetched[member] += size

    def refused(self, member: str) -> None:
        """A piece from `member` that failed its hash."""
        self.pieces_refused[member] += 1

    def served(self, member: str, size: int) -> None:
        """A piece of `size` bytes sent to `member`."""
        self.bytes_served[member] += size

    def ended(self, outcome: str, seconds: float) -> None:
        """A fetch ended (`resident` or `failed`) after `seconds`."""
        self.fetches[outcome] += 1
        self.duration_buckets[bisect.bisect_left(FETCH_BUCKETS, seconds)] += 1
        self.duration_sum += seconds
