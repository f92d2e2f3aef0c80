"""Prometheus metrics of artifact transfers (issue 28), from `ArtifactCounters`: bytes
fetched and served per member, pieces verified and refused, fetches by outcome and their
durations, and what is in flight now. Counts only: no path, no name of a file."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.artifacts.counters import FETCH_BUCKETS, ArtifactCounters

__all__ = ["ArtifactMetrics"]


class ArtifactMetrics(Collector):
    """Read at scrape time."""

    def __init__(self, counters: ArtifactCounters, fetching: Callable[[], int]) -> None:
        self._counters = counters
        self._fetching = fetching  # fetches running now

    def collect(self) -> Iterator[Metric]:
        c = self._counters
        fetched = CounterMetricFamily(
            "nvpair_artifact_fetched_bytes",
            "Bytes of artifact pieces fetched and verified, by the member that sent them",
            labels=["peer"],
        )
        for peer, size in sorted(c.bytes_fetched.items()):
            fetched.add_metric([peer], size)
        yield fetched
        served = CounterMetricFamily(
            "nvpair_artifact_served_bytes",
            "Bytes of artifact pieces served, by the member that asked",
            labels=["peer"],
        )
        for peer, size in sorted(c.bytes_served.items()):
            served.add_metric([peer], size)
        yield served
        yield CounterMetricFamily(
            "nvpair_artifact_pieces_verified",
            "Artifact pieces fetched whose SHA-256 matched the manifest",
            value=c.pieces_verified,
        )
        refused = CounterMetricFamily(
            "nvpair_artifact_pieces_refused",
            "Artifact pieces fetched that failed their SHA-256, by the member that sent them",
            labels=["peer"],
        )
        for peer, count in sorted(c.pieces_refused.items()):
            refused.add_metric([peer], count)
        yield refused
        ended = CounterMetricFamily(
            "nvpair_artifact_fetches", "Artifact fetches ended, by outcome", labels=["outcome"]
        )
        for outcome in ("resident", "failed", "stopped"):
            ended.add_metric([outcome], c.fetches[outcome])
        yield ended
        cumulative, buckets = 0, []
        for bound, count in zip((*FETCH_BUCKETS, float("inf")), c.duration_buckets, strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        yield HistogramMetricFamily(
            "nvpair_artifact_fetch_seconds",
            "How long whole artifact fetches took",
            buckets=buckets,
            sum_value=c.duration_sum,
        )
        yield GaugeMetricFamily(
            "nvpair_artifact_fetches_running",
            "Artifact fetches running now",
            value=self._fetching(),
        )
