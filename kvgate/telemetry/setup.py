"""OpenTelemetry SDK setup — called only by entry points; libraries take a tracer.

The standard ``OTEL_*`` variables decide everything, read the way the SDK's own configurator
(``opentelemetry.sdk._configuration``) reads them:

- ``OTEL_SDK_DISABLED=true`` turns tracing off.
- ``OTEL_TRACES_EXPORTER`` is a comma-separated list of exporter names (default ``otlp``;
  ``none`` alone exports nothing). Each name is looked up among the installed
  ``opentelemetry_traces_exporter`` entry points — the registry the SDK configurator uses —
  so ``console``, ``otlp_proto_grpc``, ``otlp_proto_http`` and any installed plugin work.
- ``otlp`` means the protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` names: ``grpc`` or ``http/protobuf``. Unset, kvgate takes
  ``http/protobuf``, the specification's default (the Python SDK alone defaults to gRPC).
- The exporters read their endpoint, headers, timeout, compression and TLS variables
  (``OTEL_EXPORTER_OTLP_[TRACES_]*``) themselves.
- ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the process; the service name an
  entry point passes applies only when neither sets ``service.name``.

kvgate's one rule of its own: ``otlp`` with no endpoint variable set exports nowhere (spans are
still created, they are cheap), so a development run prints no connection errors. An unknown
exporter or protocol raises ``TelemetryConfigError`` with one line naming the variable; entry
points print it and exit 2 instead of falling back silently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import entry_points

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

EXPORTER_GROUP = "opentelemetry_traces_exporter"
OTLP = "otlp"
NONE = "none"
DEFAULT_PROTOCOL = "http/protobuf"
EXPORTER_BY_PROTOCOL: Mapping[str, str] = {
    "grpc": "otlp_proto_grpc",
    "http/protobuf": "otlp_proto_http",
}
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


class TelemetryConfigError(ValueError):
    """An ``OTEL_*`` variable names an exporter or protocol this process cannot use."""


def otlp_protocol(env: Mapping[str, str]) -> str:
    """The OTLP protocol for traces: the signal's own variable first, then the general one."""
    for name in _PROTOCOL_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            if value not in EXPORTER_BY_PROTOCOL:
                supported = ", ".join(EXPORTER_BY_PROTOCOL)
                raise TelemetryConfigError(f"{name}={value!r}: OTLP protocols are {supported}")
            return value
    return DEFAULT_PROTOCOL


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The entry-point names ``OTEL_TRACES_EXPORTER`` selects, ``otlp`` resolved by protocol and
    dropped when no endpoint is configured (see the module docstring)."""
    raw = env.get("OTEL_TRACES_EXPORTER", OTLP)
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    if names == [NONE]:
        return []
    if not names or NONE in names:
        raise TelemetryConfigError(
            f"OTEL_TRACES_EXPORTER={raw!r}: a list of exporter names, or 'none' alone"
        )
    selected: list[str] = []
    for name in names:
        resolved = name
        if name == OTLP:
            protocol = otlp_protocol(env)  # checked even when unused: a typo is never silent
            if not any(env.get(variable) for variable in _ENDPOINT_VARIABLES):
                continue
            resolved = EXPORTER_BY_PROTOCOL[protocol]
        if resolved not in selected:
            selected.append(resolved)
    return selected


def load_exporter(name: str) -> SpanExporter:
    """The installed exporter registered under ``name``, constructed from the environment."""
    found = entry_points(group=EXPORTER_GROUP, name=name)
    if not found:
        installed = sorted({OTLP, NONE} | {e.name for e in entry_points(group=EXPORTER_GROUP)})
        raise TelemetryConfigError(
            f"OTEL_TRACES_EXPORTER names {name!r}, which is not installed; "
            f"installed: {', '.join(installed)}"
        )
    exporter_class = next(iter(found)).load()
    if not (isinstance(exporter_class, type) and issubclass(exporter_class, SpanExporter)):
        raise TelemetryConfigError(f"OTEL_TRACES_EXPORTER names {name!r}: not a span exporter")
    exporter: SpanExporter = exporter_class()  # reads its OTEL_EXPORTER_* variables itself
    return exporter


def build_resource(service_name: str) -> Resource:
    """The SDK's resource (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME`` and the
    configured detectors), with ``service_name`` as the default service name."""
    from_environment = OTELResourceDetector().detect()
    defaults = {} if SERVICE_NAME in from_environment.attributes else {SERVICE_NAME: service_name}
    return Resource.create(defaults)


def build_tracer_provider(service_name: str) -> TracerProvider | None:
    """The tracer provider the process's ``OTEL_*`` variables describe (None when disabled).

    Raises ``TelemetryConfigError`` for an exporter or protocol that cannot be used.
    """
    environ = os.environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = [load_exporter(name) for name in exporter_names(environ)]
    provider = TracerProvider(resource=build_resource(service_name))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install the process-wide tracer provider from the environment; returns it.

    Call it once, from an entry point, before creating tracers; shut the provider down on exit
    so batched spans are flushed. Raises ``TelemetryConfigError`` (see ``build_tracer_provider``).
    """
    provider = build_tracer_provider(service_name)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider
