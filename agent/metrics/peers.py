"""Relay and broadcast counters per peer for `/metrics`, from the manager's status.

The workload manager child counts as it relays (`workload_manager.relay.RelayCounters`)
and as each peer's outbox sends (`workload_manager.outbox.OutboxCounters`, and the payloads
heard from each peer); `manager:status` carries them and the local API asks for it just
before a scrape, so the relay's hot path does no more than the counts it already keeps.
The counts are carried across restarts of the child before they get here (`carried_counts`).
The `peer` label is a member's node id: bounded by the membership.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

__all__ = ["peer_metrics"]

# (name without `_total`, help, the status field) of each outbox counter.
_PER_PEER: Final = (
    ("nvpair_broadcast_events_sent", "Events a peer acknowledged", "sent"),
    ("nvpair_broadcast_batches_sent", "Batches a peer acknowledged", "batches"),
    ("nvpair_broadcast_batches_failed", "Batches that failed and were queued again", "retried"),
    ("nvpair_broadcast_events_dropped", "Events given up: over the cap, or malformed", "dropped"),
    ("nvpair_broadcast_events_coalesced", "Events replaced by a newer one unsent", "coalesced"),
    ("nvpair_relay_payloads_received", "Payloads (batches, catch-ups) from a peer", "heard"),
)
_DROPPED: Final = (
    ("duplicate", "duplicates"),
    ("stale", "stale"),
    ("removed", "blocked_by_tombstone"),
    ("own_origin", "own_origin"),
)


def peer_metrics(manager: Mapping[str, Any]) -> Iterator[Metric]:
    """The per-peer counters and gauges, and the relay's totals: by source, accepted, and
    dropped by reason."""
    peers = manager.get("broadcast", [])
    for name, help_text, field in _PER_PEER:
        counter = CounterMetricFamily(name, help_text, labels=["peer"])
        for peer in peers:
            counter.add_metric([peer["nodeId"]], peer.get(field, 0))
        yield counter
    failing = GaugeMetricFamily(
        "nvpair_broadcast_peer_failures",
        "Sends to a peer failed in a row (0: in step)",
        labels=["peer"],
    )
    for peer in peers:
        failing.add_metric([peer["nodeId"]], peer.get("failures", 0))
    yield failing
    relay = manager.get("counters", {})
    received = CounterMetricFamily(
        "nvpair_relay_events_received", "Workload events into the relay", labels=["source"]
    )
    received.add_metric(["local"], relay.get("received_local", 0))
    received.add_metric(["remote"], relay.get("received_remote", 0))
    yield received
    accepted = CounterMetricFamily(
        "nvpair_relay_events_accepted", "Workload events the relay took as new (first seen)"
    )
    accepted.add_metric([], relay.get("accepted", 0))
    yield accepted
    dropped = CounterMetricFamily(
        "nvpair_relay_events_dropped", "Workload events the relay dropped", labels=["reason"]
    )
    for reason, field in _DROPPED:
        dropped.add_metric([reason], relay.get(field, 0))
    yield dropped
