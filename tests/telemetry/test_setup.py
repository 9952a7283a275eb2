"""SDK setup from ``OTEL_*``: which exporters the variables select, what an unusable value says,
and which service name and resource attributes a process gets."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from kvgate.telemetry.setup import (
    TelemetryConfigError,
    build_tracer_provider,
    exporter_names,
    load_exporter,
)

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    yield


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),  # otlp by default, but no endpoint: nowhere to send
        (ENDPOINT, ["otlp_proto_http"]),  # the specification's default protocol
        (ENDPOINT | {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),
        (
            ENDPOINT
            | {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            ["otlp_proto_http"],  # the signal's own variable wins
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317/",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            },
            ["otlp_proto_grpc"],
        ),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": " Console "}, ["console"]),
        (ENDPOINT | {"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp_proto_http", "console"]),
        (
            ENDPOINT | {"OTEL_TRACES_EXPORTER": "otlp_proto_grpc,otlp"},
            ["otlp_proto_grpc", "otlp_proto_http"],
        ),
        ({"OTEL_TRACES_EXPORTER": "console,console"}, ["console"]),
    ],
)
def test_exporter_names_follow_the_variables(env: dict[str, str], expected: list[str]) -> None:
    assert exporter_names(env) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},  # refused even without an endpoint
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': OTLP protocols are grpc, http/protobuf",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "gRPC"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='gRPC'",
        ),
        ({"OTEL_TRACES_EXPORTER": "none,console"}, "or 'none' alone"),
        ({"OTEL_TRACES_EXPORTER": " , "}, "a list of exporter names"),
    ],
)
def test_unusable_values_are_refused_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(TelemetryConfigError, match=message.replace("(", r"\(")):
        exporter_names(env)


def test_an_exporter_that_is_not_installed_names_the_installed_ones() -> None:
    with pytest.raises(TelemetryConfigError) as refused:
        load_exporter("zipkin")
    assert str(refused.value).startswith("OTEL_TRACES_EXPORTER names 'zipkin', which is not")
    for installed in ("console", "none", "otlp", "otlp_proto_grpc", "otlp_proto_http"):
        assert installed in str(refused.value)


def _exporters(provider: TracerProvider) -> list[object]:
    processors = provider._active_span_processor._span_processors
    assert all(isinstance(p, BatchSpanProcessor) for p in processors)
    return [p.span_exporter for p in processors]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("protocol", "exporter_class"),
    [("grpc", GrpcSpanExporter), ("http/protobuf", HttpSpanExporter)],
)
def test_the_protocol_picks_the_exporter_class(
    monkeypatch: pytest.MonkeyPatch, protocol: str, exporter_class: type
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    provider = build_tracer_provider("svc")
    assert provider is not None
    try:
        exporters = _exporters(provider)
        assert [type(e) for e in exporters] == [exporter_class, ConsoleSpanExporter]
    finally:
        provider.shutdown()


def test_disabled_and_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = build_tracer_provider("svc")
    assert quiet is not None and _exporters(quiet) == []
    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert build_tracer_provider("svc") is None


@pytest.mark.parametrize(
    ("env", "service_name"),
    [
        ({}, "kvgate-admission"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "from-attributes"),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "x"},
            "x",
        ),
    ],
)
def test_the_service_name_is_a_default_the_environment_overrides(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], service_name: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", env.get("OTEL_RESOURCE_ATTRIBUTES", "") + ",kvgate.pool=p"
    )
    provider = build_tracer_provider("kvgate-admission")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == service_name
    assert provider.resource.attributes["kvgate.pool"] == "p"
