"""Traces of requests across processes and members, exported over OTLP/HTTP (issue 31).

Off unless `configure()` is called (the agent does when `[tracing] otlp_endpoint` is set):
until then nothing here imports OpenTelemetry, and every helper is one check of a module
global -- the facade's hot path pays nothing for a feature it does not use.

On, spans are made with OpenTelemetry's SDK and kept in a bounded queue that a thread
empties to the collector with the SDK's OTLP/HTTP exporter (netkit.trace_batches): a span
ending never waits for the network; what the collector does not get is counted. The queue's
and the batches' sizes and the delay between exports are the standard
`OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and `OTEL_BSP_SCHEDULE_DELAY`
(milliseconds); the exporter's own timeout and headers its `OTEL_EXPORTER_OTLP_TRACES_*`.

The context travels as W3C Trace Context (`traceparent`, `tracestate`): `extracted()` reads a
caller's from headers, `injected()` gives the headers a call made now carries. The current
span is OpenTelemetry's, in a context variable: the calls an asyncio task makes are made
within the span that task is in.

Span attributes are what the caller puts there; this module never adds a request's content.
Exceptions are not recorded on spans (an exception's message may quote what it was given);
a caller sets a span's error with words of its own (`failed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from netkit.trace_batches import Batches

__all__ = [
    "configure",
    "current_ids",
    "env_count",
    "extracted",
    "failed",
    "injected",
    "note",
    "on",
    "shutdown",
    "span",
]

log = logging.getLogger(__name__)

Attributes = Mapping[str, str | bool | int | float]

_KINDS: Final = ("internal", "server", "client")

_tracer: Tracer | None = None
_batches: Batches | None = None
_propagator: Any = None  # TraceContextTextMapPropagator, once configured
_off: Final[AbstractContextManager[None]] = contextlib.nullcontext()


def configure(
    endpoint: str,
    *,
    service: str,
    instance: str,
    attributes: Attributes | None = None,
    sample_ratio: float = 1.0,
    exporter: SpanExporter | None = None,
) -> Batches:
    """Turn tracing on in this process: spans of `service` (its `instance`: a node id),
    a `sample_ratio` of new traces sampled (a caller's sampled flag is followed), exported
    to `endpoint` (OTLP/HTTP, `http://collector:4318/v1/traces`)."""
    global _tracer, _batches, _propagator
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from netkit.trace_batches import DELAY_MS, MAX_BATCH, MAX_QUEUE, Batches

    # The exporter logs each failed batch with a traceback's worth of words; `Batches` says
    # it once a minute instead.
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    resource = Resource.create(
        {"service.name": service, "service.instance.id": instance, **(attributes or {})}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    batches = Batches(
        exporter or OTLPSpanExporter(endpoint=endpoint),
        max_queue=env_count("OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUE),
        max_batch=env_count("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_BATCH),
        delay_s=env_count("OTEL_BSP_SCHEDULE_DELAY", DELAY_MS) / 1000,
        where=endpoint,
    )
    provider.add_span_processor(batches)
    _propagator = TraceContextTextMapPropagator()
    _tracer = provider.get_tracer("nvpair")
    _batches = batches
    log.info("tracing on: spans to %s (sampling %g of new traces)", endpoint, sample_ratio)
    return batches


def env_count(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The positive whole number the environment sets `name` to; `default` (said once in
    the log) when it sets something else: a typo in a variable must not stop an agent."""
    given = (os.environ if environ is None else environ).get(name)
    if given is None:
        return default
    try:
        value = int(given)
    except ValueError:
        value = 0
    if value <= 0:
        log.warning("%s=%r is not a positive whole number: %d it is", name, given[:32], default)
        return default
    return value


def shutdown() -> None:
    """Export what is queued and turn tracing off (at a process's end)."""
    global _tracer, _batches, _propagator
    batches, _tracer, _batches, _propagator = _batches, None, None, None
    if batches is not None:
        batches.shutdown()


def on() -> bool:
    """Whether spans are made in this process."""
    return _tracer is not None


def span(
    name: str,
    *,
    kind: str = "internal",
    parent: Context | None = None,
    attributes: Attributes | None = None,
) -> AbstractContextManager[Span | None]:
    """A span made current for the block (None when tracing is off), a child of `parent`
    (from `extracted`) or else of the current span. `kind`: internal, server or client."""
    tracer = _tracer
    if tracer is None:
        return _off
    from opentelemetry.trace import SpanKind

    assert kind in _KINDS, kind
    return tracer.start_as_current_span(
        name,
        context=parent,
        kind=SpanKind[kind.upper()],
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


def extracted(headers: Mapping[str, str]) -> Context | None:
    """The caller's context from its `traceparent` (None when off, or none was sent: the
    span then starts a trace of its own)."""
    if _propagator is None or "traceparent" not in headers:
        return None
    context: Context = _propagator.extract(headers)
    return context


def injected() -> dict[str, str]:
    """The W3C headers a call made now carries (empty when off or outside a span)."""
    if _propagator is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def note(attributes: Attributes, *, error: str | None = None) -> None:
    """Set `attributes` on the current span, and mark it failed with `error` when given (our
    phrase, as `failed`); nothing when off or outside a span."""
    if _tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    current.set_attributes(attributes)
    if error:
        failed(current, error)


def failed(span: Span | None, phrase: str) -> None:
    """Mark `span` failed with `phrase` (ours, of a closed vocabulary; never a message
    quoting a request or an answer)."""
    if span is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, phrase))


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for a log line; None when off or
    outside a span."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"
