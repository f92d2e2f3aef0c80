"""Durations counted into fixed buckets, exported as a Prometheus histogram at scrape time
(for the parts whose metrics are read by a collector, not kept in a registry)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from prometheus_client.core import HistogramMetricFamily

__all__ = ["Timings"]


class Timings:
    """A histogram's counts: one per bucket bound, and one above the last."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration."""
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds

    @property
    def count(self) -> int:
        """How many durations were counted."""
        return sum(self.counts)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """The histogram as Prometheus reads it (cumulative buckets, `le` bounds)."""
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total_s)
