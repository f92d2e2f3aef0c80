"""The gauges that exported cumulative counts before their counters existed (issue 25).

`rate()` and `increase()` are only right on a counter: a gauge that falls when its source
restarts reads as a huge negative rate, not as a reset. Each count below is now a counter
named `..._total`; its older gauge is kept beside it for one release, with the same value,
so existing alerts keep working while they move, and its HELP says what replaces it.
docs/metrics.md lists them as deprecated. Remove this module and its callers in the next
release.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from prometheus_client.core import GaugeMetricFamily

__all__ = ["DEPRECATED", "deprecated_gauge"]

# old gauge -> (what it counts, the series that replaces it, its labels)
DEPRECATED: Final[dict[str, tuple[str, str, tuple[str, ...]]]] = {
    "nvpair_relay_received_remote": (
        "Workload events the relay received from peers",
        'nvpair_relay_events_received_total{source="remote"}',
        (),
    ),
    "nvpair_relay_received_local": (
        "Workload events the relay received from this node's broker",
        'nvpair_relay_events_received_total{source="local"}',
        (),
    ),
    "nvpair_relay_accepted": (
        "Workload events the relay took as new",
        "nvpair_relay_events_accepted_total",
        (),
    ),
    "nvpair_relay_duplicates": (
        "Workload events the relay dropped as duplicates",
        'nvpair_relay_events_dropped_total{reason="duplicate"}',
        (),
    ),
    "nvpair_relay_stale": (
        "Workload events the relay dropped as older than what it held",
        'nvpair_relay_events_dropped_total{reason="stale"}',
        (),
    ),
    "nvpair_relay_redundant_deliveries": (
        "Records the workload manager delivered as new that the Jobs store already held",
        "nvpair_relay_redundant_deliveries_total",
        (),
    ),
    "nvpair_broadcast_retried": (
        "Broadcast batches to a peer that failed and were queued again",
        "nvpair_broadcast_batches_failed_total",
        ("peer",),
    ),
    "nvpair_manager_restarts": (
        "Restarts of the workload manager child",
        "nvpair_manager_restarts_total",
        (),
    ),
    "nvpair_manager_dropped_frames": (
        "Frames the supervisor could not hand to the workload manager",
        "nvpair_manager_dropped_frames_total",
        (),
    ),
    "nvpair_usage_rows_dropped": (
        "Usage rows dropped because the buffer was full",
        "nvpair_usage_rows_dropped_total",
        (),
    ),
    "nvpair_anti_entropy_rounds": (
        "Anti-entropy rounds with members",
        "nvpair_anti_entropy_rounds_total",
        (),
    ),
    "nvpair_anti_entropy_failed": (
        "Anti-entropy rounds that failed",
        "nvpair_anti_entropy_failed_total",
        (),
    ),
    "nvpair_anti_entropy_differing_buckets": (
        "Digest buckets that differed from a member's",
        "nvpair_anti_entropy_differing_buckets_total",
        (),
    ),
    "nvpair_anti_entropy_records_in": (
        "Job records and removals taken from members by anti-entropy",
        "nvpair_anti_entropy_records_in_total",
        (),
    ),
    "nvpair_anti_entropy_records_out": (
        "Job records and removals sent to members by anti-entropy",
        "nvpair_anti_entropy_records_out_total",
        (),
    ),
    "nvpair_anti_entropy_own_origin": (
        "Records a member sent in anti-entropy claiming this node's origin, dropped",
        "nvpair_anti_entropy_own_origin_total",
        (),
    ),
    "nvpair_plane_synced_jobs": (
        "Job records the plane acknowledged",
        "nvpair_plane_synced_jobs_total",
        (),
    ),
}


def deprecated_gauge(
    name: str, samples: Iterable[tuple[Sequence[str], float]]
) -> GaugeMetricFamily:
    """The deprecated gauge `name` (a key of `DEPRECATED`) with `samples` (labels, value)."""
    meaning, instead, labels = DEPRECATED[name]
    gauge = GaugeMetricFamily(
        name, f"{meaning} (deprecated, removed in the next release: use {instead})", labels=labels
    )
    for values, value in samples:
        gauge.add_metric(values, value)
    return gauge
