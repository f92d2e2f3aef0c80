"""Prometheus metrics of the local API: counts and gauges only, never a prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from broker.inventory import GpuInventory

from .peer_metrics import peer_metrics

__all__ = ["STATES", "AgentMetrics"]

STATES: Final = ("queued", "running", "completed", "failed", "cancelled")


class AgentMetrics(Collector):
    """Gauges read from the agent at scrape time; never a prompt, only counts."""

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
        # The manager's status and the job counts, read (async) just before each scrape.
        self.snapshot: tuple[dict[str, Any], dict[str, int]] = ({}, {})

    def collect(self) -> Any:
        manager, counts = self.snapshot
        jobs = GaugeMetricFamily("nvpair_jobs", "Jobs in the Jobs list by state", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        relay = manager.get("counters", {})
        for name, help_text in (
            ("received_remote", "Workload events received from peers"),
            ("received_local", "Workload events received from the broker"),
            ("accepted", "Workload events that were new"),
            ("duplicates", "Duplicate workload events dropped"),
            ("stale", "Stale workload events dropped"),
        ):
            gauge = GaugeMetricFamily(f"nvpair_relay_{name}", help_text)
            gauge.add_metric([], relay.get(name, 0))
            yield gauge
        retries = GaugeMetricFamily(
            "nvpair_broadcast_retried", "Broadcast batches retried", labels=["peer"]
        )
        depth = GaugeMetricFamily(
            "nvpair_broadcast_queue_depth", "Events waiting for a peer", labels=["peer"]
        )
        for peer in manager.get("broadcast", []):
            retries.add_metric([peer["nodeId"]], peer.get("retried", 0))
            depth.add_metric([peer["nodeId"]], peer.get("queued", 0))
        yield retries
        yield depth
        yield from peer_metrics(manager)
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
        restarts = GaugeMetricFamily("nvpair_manager_restarts", "Workload manager restarts")
        restarts.add_metric([], self._restarts())
        yield restarts
        dropped = GaugeMetricFamily(
            "nvpair_manager_dropped_frames",
            "Frames the supervisor could not hand to the workload manager (not reading)",
        )
        dropped.add_metric([], self._dropped())
        yield dropped
        redundant = GaugeMetricFamily(
            "nvpair_relay_redundant_deliveries",
            "Records the workload manager delivered as new that the Jobs store already held",
        )
        redundant.add_metric([], self._redundant())
        yield redundant
        pending = GaugeMetricFamily(
            "nvpair_jobs_writer_pending",
            "Records and removals handed to the Jobs writer and not yet committed",
        )
        pending.add_metric([], self._writer_pending())
        yield pending
        for name, value in sorted(self._repairs().items()):
            gauge = GaugeMetricFamily(
                f"nvpair_anti_entropy_{name}", f"Anti-entropy rounds with members: {name}"
            )
            gauge.add_metric([], value)
            yield gauge
        plane = self._plane()
        if plane is not None:
            failing = GaugeMetricFamily(
                "nvpair_plane_sync_failures", "Plane sync attempts failed in a row (0: in sync)"
            )
            failing.add_metric([], plane["failures"])
            yield failing
            synced = GaugeMetricFamily(
                "nvpair_plane_synced_jobs", "Job records the plane acknowledged since start"
            )
            synced.add_metric([], plane["synced"])
            yield synced
            if "desiredFailures" in plane:
                fetching = GaugeMetricFamily(
                    "nvpair_plane_desired_failures",
                    "Fetches of the plane's desired state failed in a row (0: in step)",
                )
                fetching.add_metric([], plane["desiredFailures"])
                yield fetching
