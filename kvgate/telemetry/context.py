"""W3C trace context carried as a ``traceparent`` string (Kafka headers, step plans)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def context_from_traceparent(traceparent: str | None) -> Context | None:
    """A context whose current span is the remote parent, or None when absent or invalid."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def span_context_from_traceparent(traceparent: str | None) -> SpanContext | None:
    context = context_from_traceparent(traceparent)
    return None if context is None else trace.get_current_span(context).get_span_context()


def traceparent_of(span_context: SpanContext) -> str:
    """The ``traceparent`` header value naming ``span_context``."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    return carrier["traceparent"]
