"""The span queue behind tracing (netkit.trace_batches) with OpenTelemetry's SDK and its real
OTLP/HTTP exporter: a full queue drops and counts, a collector that is away costs counted
spans and never a caller's time, one that answers gets every span; and with tracing off,
nothing loads OpenTelemetry at all."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest_asyncio
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from netkit.trace_batches import Batches
from netkit.tracing import env_count
from tests.fixtures.waiting import eventually
from tests.workload_manager.cluster_harness import free_port


def _tracer(batches: Batches) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(batches)
    return provider


def _end(provider: TracerProvider, count: int) -> None:
    tracer = provider.get_tracer("test")
    for i in range(count):
        with tracer.start_as_current_span(f"s{i}"):
            pass


def test_a_full_queue_drops_the_new_spans_and_counts_them() -> None:
    kept = InMemorySpanExporter()
    batches = Batches(kept, max_queue=4, max_batch=2, delay_s=3600)
    provider = _tracer(batches)
    try:
        _end(provider, 10)
        assert (batches.queued(), batches.dropped) == (4, 6)
        assert batches.force_flush(10_000)
        assert batches.exported == 4
        assert [s.name for s in kept.get_finished_spans()] == ["s0", "s1", "s2", "s3"]
    finally:
        provider.shutdown()


class Collector:
    """An OTLP/HTTP receiver that can be held: its answers wait while `held` is clear."""

    def __init__(self) -> None:
        self.spans = 0
        self.arrived = asyncio.Event()  # an export is in
        self.held = asyncio.Event()
        self.held.set()

    async def export(self, request: web.Request) -> web.Response:
        request_spans = ExportTraceServiceRequest()
        request_spans.ParseFromString(await request.read())
        self.arrived.set()
        await self.held.wait()
        for resource in request_spans.resource_spans:
            for scope in resource.scope_spans:
                self.spans += len(scope.spans)
        return web.Response(content_type="application/x-protobuf")


@pytest_asyncio.fixture
async def collector() -> AsyncIterator[tuple[Collector, str]]:
    made = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", made.export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield made, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
    made.held.set()
    await runner.cleanup()


async def test_a_collector_away_costs_counted_spans_and_a_held_one_blocks_no_caller(
    collector: tuple[Collector, str],
) -> None:
    # Away: nothing listens. The spans are counted as failed, none as exported.
    away = Batches(
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{free_port()}/v1/traces", timeout=1),
        delay_s=3600,
    )
    provider = _tracer(away)
    try:
        _end(provider, 3)
        assert await asyncio.to_thread(away.force_flush, 30_000)
        assert (away.failed, away.exported) == (3, 0)
    finally:
        await asyncio.to_thread(provider.shutdown)

    # There, but holding its answer: spans still end at once, on this very loop (which the
    # collector needs to answer: a span that waited for the export would deadlock it).
    received, url = collector
    received.held.clear()
    held = Batches(OTLPSpanExporter(endpoint=url, timeout=30), max_queue=8, delay_s=3600)
    provider = _tracer(held)
    try:
        _end(provider, 2)
        held.force_flush(0)  # start the export; it waits for the collector
        await received.arrived.wait()
        _end(provider, 20)  # while the export hangs: 8 queued, 12 dropped
        assert (held.queued(), held.dropped) == (8, 12)
        received.held.set()
        assert await asyncio.to_thread(held.force_flush, 30_000)
        assert (held.exported, held.failed) == (10, 0)
        await eventually(lambda: received.spans == 10, "the collector counted every span sent")
    finally:
        await asyncio.to_thread(provider.shutdown)


def test_with_tracing_off_nothing_loads_opentelemetry() -> None:
    code = (
        "import sys, agent.app.daemon, agent.serving.facade, agent.mock.engine\n"
        "from agent.core.request_identity import outgoing\n"
        "assert outgoing() == {}, outgoing()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
        "import netkit.trace_batches\n"  # the control: this one does load it
        "assert 'opentelemetry.sdk.trace' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_malformed_batch_setting_falls_back_to_its_default() -> None:
    assert env_count("OTEL_BSP_MAX_QUEUE_SIZE", 2048, {"OTEL_BSP_MAX_QUEUE_SIZE": "64"}) == 64
    for bad in ("lots", "0", "-5", "1.5", ""):
        assert env_count("OTEL_BSP_MAX_QUEUE_SIZE", 2048, {"OTEL_BSP_MAX_QUEUE_SIZE": bad}) == 2048
    assert env_count("OTEL_BSP_MAX_QUEUE_SIZE", 2048, {}) == 2048
