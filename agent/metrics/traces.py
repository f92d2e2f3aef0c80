"""Tracing in the agent: turned on from `[tracing]` (netkit.tracing), and what became of
its spans in /metrics -- exported, dropped because the queue was full, or in a batch the
collector did not take -- so an operator sees a collector that is away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.config import TracingTable
from netkit import tracing

if TYPE_CHECKING:
    from netkit.trace_batches import Batches  # loads the SDK: only once tracing is on

__all__ = ["TraceMetrics", "start_tracing"]


def start_tracing(
    table: TracingTable, node_id: str, name: str, stack: contextlib.AsyncExitStack
) -> Batches | None:
    """Turn tracing on when `table` names a collector; its span queue, else None. What is
    queued is sent when `stack` closes (pushed first: once all else has stopped)."""
    if table.otlp_endpoint is None:
        return None
    batches = tracing.configure(
        table.otlp_endpoint,
        service=table.service_name,
        instance=node_id,
        attributes={"nvpair.node.name": name},
        sample_ratio=table.sample_ratio,
    )
    stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
    return batches


class TraceMetrics(Collector):
    """Read at scrape time."""

    def __init__(self, batches: Batches | None) -> None:
        self._batches = batches  # None: tracing is off, nothing to say

    def collect(self) -> Iterator[Metric]:
        b = self._batches
        if b is None:
            return
        spans = CounterMetricFamily(
            "nvpair_trace_spans",
            "Spans ended, by what became of them: exported, dropped (the queue was full) or "
            "failed (in a batch the collector did not take)",
            labels=["outcome"],
        )
        for outcome, count in (
            ("exported", b.exported),
            ("dropped", b.dropped),
            ("failed", b.failed),
        ):
            spans.add_metric([outcome], count)
        yield spans
        yield GaugeMetricFamily(
            "nvpair_trace_spans_queued", "Spans waiting to be exported", value=b.queued()
        )
