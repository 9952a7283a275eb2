"""OpenTelemetry SDK setup — called only by entry points; libraries take a tracer.

The standard ``OTEL_*`` variables decide everything: ``OTEL_SDK_DISABLED=true`` turns tracing off,
``OTEL_TRACES_EXPORTER`` (``otlp`` by default, ``console``, or ``none``) picks the exporter, the
``OTEL_EXPORTER_OTLP_*`` variables configure OTLP/HTTP, and ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES`` name the process. Without any exporter endpoint configured, spans are
created (they are cheap) but exported nowhere, so a development run prints no connection errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def _exporter(env: Mapping[str, str]) -> SpanExporter | None:
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: kvgate supports otlp, console or none")
    if not any(env.get(name) for name in _ENDPOINT_VARIABLES):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter,
    )

    return OTLPSpanExporter()  # reads the OTEL_EXPORTER_OTLP_* variables itself


def build_tracer_provider(
    service_name: str, env: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """The tracer provider the ``OTEL_*`` variables in ``env`` describe (None when disabled).

    ``service_name`` is the default that ``OTEL_SERVICE_NAME`` overrides.
    """
    environ = os.environ if env is None else env
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    exporter = _exporter(environ)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install the process-wide tracer provider from the environment; returns it.

    Call it once, from an entry point, before creating tracers; shut the provider down on exit
    so batched spans are flushed.
    """
    provider = build_tracer_provider(service_name)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider
