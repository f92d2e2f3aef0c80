"""The span processor behind netkit.tracing: ended spans in a bounded queue, exported by a
thread of its own in batches with the SDK's exporter. A span ending never waits for the
network; a queue that is full drops the new span and counts it; a batch the collector did
not take (away, refusing, too slow) is counted as failed, with one log line a minute at most.

Imported only once tracing is on: it loads OpenTelemetry's SDK."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from netkit.sites import PerSourceRate

__all__ = ["DELAY_MS", "MAX_BATCH", "MAX_QUEUE", "Batches"]

log = logging.getLogger(__name__)

MAX_QUEUE: Final = 2048  # spans waiting for export (OTEL_BSP_MAX_QUEUE_SIZE)
MAX_BATCH: Final = 512  # spans per export (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)
DELAY_MS: Final = 5000  # between exports (OTEL_BSP_SCHEDULE_DELAY)
FLUSH_S: Final = 2.0  # what `shutdown()` gives the last export at most (an agent stops in 10 s)


class Batches(SpanProcessor):
    """A span processor: ended spans in a bounded queue, exported by a thread in batches.

    Counts, read by the agent's /metrics: `exported` (taken by the collector), `dropped`
    (the queue was full), `failed` (in a batch the collector did not take)."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = MAX_QUEUE,
        max_batch: int = MAX_BATCH,
        delay_s: float = DELAY_MS / 1000,
        where: str = "",
    ) -> None:
        self._exporter = exporter
        self._max_queue = max(1, max_queue)
        self._max_batch = max(1, min(max_batch, self._max_queue))
        self._delay_s = delay_s
        self._where = where  # the collector, for the log line
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()  # nothing queued and no export running
        self._idle.set()
        self._stopping = False
        self._failures = PerSourceRate(per_s=1 / 60, burst=1)  # a log line a minute
        self._unlogged = 0
        self.exported = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._run, name="nvpair-traces", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do when a span starts."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue an ended span (sampled ones only); drop and count it when the queue is full."""
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        with self._lock:
            if self._stopping or len(self._queue) >= self._max_queue:
                self.dropped += 1
                return
            self._queue.append(span)
            self._idle.clear()
            full = len(self._queue) >= self._max_batch
        if full:
            self._wake.set()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export what is queued now; whether the queue emptied within the timeout."""
        self._wake.set()
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Export what is queued (within `FLUSH_S`), then stop the thread and the exporter."""
        self._stopping = True
        self._wake.set()
        self._thread.join(FLUSH_S)
        self._exporter.shutdown()

    def queued(self) -> int:
        """Spans waiting for export now."""
        return len(self._queue)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            stopping = self._stopping
            self._export_all()
            if stopping:
                return

    def _export_all(self) -> None:
        while True:
            with self._lock:
                count = min(self._max_batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(count)]
                if not batch:
                    self._idle.set()
                    return
            self._export(batch)

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception as exc:  # an exporter's bug must not end the thread
            log.debug("exporting spans raised %r", exc)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(batch)
            return
        self.failed += len(batch)
        self._unlogged += len(batch)
        if self._failures.allow("export"):
            log.warning(
                "traces: %d spans not taken by the collector at %s (it is away or refused them)",
                self._unlogged,
                self._where,
            )
            self._unlogged = 0
