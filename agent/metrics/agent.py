"""Prometheus metrics of the local API: counts and gauges only, never a prompt.

A cumulative count is a counter named `..._total` (issue 25): Prometheus' `rate()` and
`increase()` read a counter that falls as a reset, a gauge as a fall. The counts of the
workload manager child are carried across its restarts (`carried_counts`), so none falls
while the agent lives. The gauges that exported those counts before keep their names for
one release (`metric_aliases`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.core.metric_aliases import DEPRECATED, deprecated_gauge
from agent.metrics.carried import CarriedCounts, carried_status
from agent.metrics.peers import peer_metrics
from facts.inventory import GpuInventory

__all__ = ["REPAIRS", "STATES", "AgentMetrics"]

STATES: Final = ("queued", "running", "completed", "failed", "cancelled")

# The relay's counts in `manager:status` still exported under their older gauge names.
_RELAY_GAUGES: Final = ("received_remote", "received_local", "accepted", "duplicates", "stale")

# Each anti-entropy count (`repair.RepairCounters`), as `nvpair_anti_entropy_<name>_total`.
REPAIRS: Final = {
    "rounds": "Anti-entropy rounds this node started with a member",
    "failed": "Anti-entropy rounds that failed (the member unreachable or refusing)",
    "differing_buckets": "Digest buckets of the Jobs store that differed from a member's",
    "records_in": "Job records and removals anti-entropy took from members",
    "records_out": "Job records and removals anti-entropy sent to members",
    "own_origin": "Records and removals a member sent claiming this node's origin, dropped",
    "unproven_own": "Rows in this node's name a member holds, not asked back: not of its runs",
    "loads": "Times the Jobs store was read whole for the anti-entropy digest",
}


class AgentMetrics(Collector):
    """Counts and gauges read from the agent at scrape time; never a prompt, only counts."""

    def __init__(
        self,
        gpus: Callable[[], GpuInventory],
        restarts: Callable[[], int],
        plane: Callable[[], dict[str, Any] | None] = lambda: None,
        dropped: Callable[[], int] = lambda: 0,
        redundant: Callable[[], int] = lambda: 0,
        repairs: Callable[[], dict[str, int]] = dict,
        writer_pending: Callable[[], int] = lambda: 0,
    ) -> None:
        self._writer_pending = writer_pending  # rows handed to the Jobs writer, not committed
        self._repairs = repairs  # anti-entropy counters: rounds, failed, records_in, ...
        self._gpus = gpus
        self._restarts = restarts
        self._dropped = dropped  # frames the supervisor could not hand to the manager
        self._redundant = redundant  # records the relay delivered that the store had
        self._plane = plane  # (failed attempts in a row, jobs synced) when syncing to a plane
        self._carried: CarriedCounts[tuple[str, ...]] = CarriedCounts()
        # The manager's status (its counts carried) and the job counts, read (async) just
        # before each scrape: `take`.
        self.snapshot: tuple[dict[str, Any], dict[str, int]] = ({}, {})

    def take(
        self, manager: Mapping[str, Any], generation: int | None, counts: dict[str, int]
    ) -> None:
        """The manager's status as its child of `generation` answered it (None: no answer,
        or the child changed meanwhile) and the Jobs list's counts, for the next scrape."""
        self.snapshot = (carried_status(self._carried, generation, manager), counts)

    def collect(self) -> Iterator[Metric]:
        manager, counts = self.snapshot
        jobs = GaugeMetricFamily("nvpair_jobs", "Jobs in the Jobs list by state", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        relay = manager.get("counters", {})
        for name in _RELAY_GAUGES:
            yield deprecated_gauge(f"nvpair_relay_{name}", [([], relay.get(name, 0))])
        peers = manager.get("broadcast", [])
        depth = GaugeMetricFamily(
            "nvpair_broadcast_queue_depth", "Events waiting for a peer", labels=["peer"]
        )
        for peer in peers:
            depth.add_metric([peer["nodeId"]], peer.get("queued", 0))
        yield depth
        retried = [([p["nodeId"]], p.get("retried", 0)) for p in peers]
        yield deprecated_gauge("nvpair_broadcast_retried", retried)
        yield from peer_metrics(manager)
        yield from self._gpu_metrics()
        yield from _counted(
            "nvpair_manager_restarts",
            "Restarts of the workload manager child since the agent started",
            self._restarts(),
        )
        yield from _counted(
            "nvpair_manager_dropped_frames",
            "Frames the supervisor could not hand to the workload manager (not reading)",
            self._dropped(),
        )
        yield from _counted(
            "nvpair_relay_redundant_deliveries",
            "Records the workload manager delivered as new that the Jobs store already held",
            self._redundant(),
        )
        pending = GaugeMetricFamily(
            "nvpair_jobs_writer_pending",
            "Records and removals handed to the Jobs writer and not yet committed",
        )
        pending.add_metric([], self._writer_pending())
        yield pending
        repairs = self._repairs()
        for name, help_text in REPAIRS.items():
            yield from _counted(f"nvpair_anti_entropy_{name}", help_text, repairs.get(name, 0))
        yield from self._plane_metrics()

    def _gpu_metrics(self) -> Iterator[Metric]:
        memory_total = GaugeMetricFamily(
            "nvpair_gpu_memory_total_bytes", "GPU memory", labels=["device", "class"]
        )
        memory_used = GaugeMetricFamily(
            "nvpair_gpu_memory_used_bytes", "GPU memory in use", labels=["device", "class"]
        )
        utilization = GaugeMetricFamily(
            "nvpair_gpu_utilization_percent", "GPU utilisation", labels=["device", "class"]
        )
        for device in self._gpus().devices:
            labels = [device.id, device.deviceClass]
            memory_total.add_metric(labels, device.memoryTotal)
            memory_used.add_metric(labels, device.memoryUsed)
            utilization.add_metric(labels, device.utilization or 0)
        yield memory_total
        yield memory_used
        yield utilization

    def _plane_metrics(self) -> Iterator[Metric]:
        plane = self._plane()
        if plane is None:
            return
        failing = GaugeMetricFamily(
            "nvpair_plane_sync_failures", "Plane sync attempts failed in a row (0: in sync)"
        )
        failing.add_metric([], plane["failures"])
        yield failing
        yield from _counted(
            "nvpair_plane_synced_jobs",
            "Job records the plane acknowledged since the agent started",
            plane["synced"],
        )
        if "desiredFailures" in plane:
            fetching = GaugeMetricFamily(
                "nvpair_plane_desired_failures",
                "Fetches of the plane's desired state failed in a row (0: in step)",
            )
            fetching.add_metric([], plane["desiredFailures"])
            yield fetching


def _counted(name: str, help_text: str, value: float) -> Iterator[Metric]:
    """A count as the counter `name_total`, and as its older gauge `name` where it had one
    (deprecated)."""
    counter = CounterMetricFamily(name, help_text)
    counter.add_metric([], value)
    yield counter
    if name in DEPRECATED:  # a count new since the gauges were retired has no gauge
        yield deprecated_gauge(name, [([], value)])
