"""A real OpenTelemetry Collector for tests, built from Go modules.

The Go program in ``otelcol/`` is the collector's own ``otelcol`` command (the assembly the
collector's builder generates for a distribution) with two components linked in: the core
``otlp`` receiver, serving OTLP over gRPC and over HTTP, and contrib's ``file`` exporter, which
writes every batch it is given as one line of OTLP JSON. A test sends spans to the collector the
way a deployment would and reads back what the collector itself decoded, batched and wrote.
Versions: collector v0.161.0 (core modules v1.67.0), contrib fileexporter v0.161.0.

It is built once per recipe into ``<cache>/otelcol/bin-<hash>/otelcol`` (``go_build.py``): about
2.5 CPU-minutes cold (4.5 min wall on a busy 2-core machine), seconds warm, 34 MB.

:class:`Collector` runs it on 127.0.0.1 with both receivers on free ports; ``spans()`` parses
the exporter's file into :class:`~tests.telemetry.otlp_receivers.ReceivedSpan` records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.harness.daemon import Daemon
from tests.harness.go_build import GoRecipe, build_recipe, recipe_files
from tests.harness.system import HarnessError, Progress, free_port, log_progress, port_accepts
from tests.telemetry.otlp_receivers import ReceivedSpan

RECIPE_DIR = Path(__file__).with_name("otelcol")
VERSION = "0.161.0"
_READY_TIMEOUT_S = 60
_FLUSH_INTERVAL = "100ms"


def recipe() -> GoRecipe:
    return GoRecipe(
        name="otelcol",
        directory=RECIPE_DIR,
        files=recipe_files(RECIPE_DIR),
        package=".",
        binary="otelcol",
    )


def build(progress: Progress = log_progress) -> Path:
    """The collector binary for the current recipe, built on first use."""
    return build_recipe(recipe(), progress, cold_estimate="about 2.5 CPU-minutes")


def collector_config(*, grpc: str, http: str, traces_file: Path) -> dict[str, Any]:
    """OTLP in on ``grpc`` and ``http`` (host:port), traces out to ``traces_file`` as JSON lines.

    The collector's own metrics are off (they would listen on 8888) and its logs go to stderr.
    """
    return {
        "receivers": {
            "otlp": {"protocols": {"grpc": {"endpoint": grpc}, "http": {"endpoint": http}}}
        },
        "exporters": {
            "file": {"path": str(traces_file), "format": "json", "flush_interval": _FLUSH_INTERVAL}
        },
        "service": {
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
        },
    }


class Collector:
    """One running collector (a context manager): :attr:`grpc_endpoint`, :attr:`http_endpoint`
    take OTLP, :meth:`spans` reads back what it exported."""

    def __init__(self, binary: Path, *, progress: Progress = log_progress) -> None:
        self.binary = binary
        self._daemon = Daemon("otelcol", progress)
        self.grpc_port = 0
        self.http_port = 0
        self.traces_file = self._daemon.workdir / "traces.jsonl"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def endpoint(self, protocol: str) -> str:
        """The endpoint for ``OTEL_EXPORTER_OTLP_PROTOCOL``'s value (``grpc``, ``http/*``)."""
        return self.grpc_endpoint if protocol == "grpc" else self.http_endpoint

    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        config = self._daemon.workdir / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                collector_config(
                    grpc=f"127.0.0.1:{self.grpc_port}",
                    http=f"127.0.0.1:{self.http_port}",
                    traces_file=self.traces_file,
                )
            )
        )
        self._daemon.progress(
            f"starting the OpenTelemetry Collector (OTLP gRPC {self.grpc_port}, HTTP "
            f"{self.http_port}); log: {self._daemon.log_path}"
        )
        self._daemon.start([str(self.binary), f"--config={config}"])
        try:
            self._daemon.wait_until(
                lambda: (
                    port_accepts("127.0.0.1", self.grpc_port)
                    and port_accepts("127.0.0.1", self.http_port)
                ),
                timeout_s=_READY_TIMEOUT_S,
                what="OTLP receivers listening",
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._daemon.stop()

    def log(self) -> str:
        return self._daemon.log()

    def spans(self) -> list[ReceivedSpan]:
        """Every span the file exporter has written so far (complete lines only)."""
        try:
            data = self.traces_file.read_text()
        except FileNotFoundError:
            return []
        complete, _, _partial = data.rpartition("\n")  # a line still being written waits
        spans: list[ReceivedSpan] = []
        for number, line in enumerate(complete.splitlines(), start=1):
            if line.strip():
                try:
                    spans += parse_traces_line(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    raise HarnessError(
                        f"{self.traces_file}:{number}: not OTLP JSON traces ({exc!r})"
                    ) from exc
        return spans

    def wait_for_spans(
        self, condition: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float, what: str
    ) -> list[ReceivedSpan]:
        """Poll the exported spans until ``condition`` holds for them."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if condition(spans):
                return spans
            if not self._daemon.alive:
                raise HarnessError(f"the collector exited; log:\n{self.log()}")
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(
                    f"timed out after {timeout_s:.0f} s waiting for {what}; the collector "
                    f"exported {len(spans)} spans: {names}\ncollector log:\n{self.log()}"
                )
            time.sleep(0.1)


# ------------------------------------------------------------------ OTLP JSON (the exporter's)
def _value(value: dict[str, Any]) -> Any:
    """An OTLP JSON ``AnyValue``: 64-bit integers arrive as strings, arrays and maps nested."""
    if not value:
        return None
    [(kind, inner)] = value.items()
    if kind == "intValue":
        return int(inner)
    if kind == "arrayValue":
        return [_value(v) for v in inner.get("values", [])]
    if kind == "kvlistValue":
        return _attributes(inner.get("values", []))
    if kind in ("stringValue", "boolValue", "doubleValue", "bytesValue"):
        return inner
    raise ValueError(f"unknown OTLP value kind {kind!r}")


def _attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    return {pair["key"]: _value(pair.get("value", {})) for pair in pairs}


def parse_traces_line(document: dict[str, Any]) -> list[ReceivedSpan]:
    """One line of the file exporter (an ``ExportTraceServiceRequest`` in OTLP JSON)."""
    spans = []
    for resource_spans in document["resourceSpans"]:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                spans.append(
                    ReceivedSpan(
                        name=span["name"],
                        trace_id=span["traceId"],
                        span_id=span["spanId"],
                        parent_span_id=span.get("parentSpanId") or None,
                        attributes=_attributes(span.get("attributes", [])),
                        links=[(link["traceId"], link["spanId"]) for link in span.get("links", [])],
                        resource=resource,
                    )
                )
    return spans
