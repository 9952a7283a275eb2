"""``kvgate admission-service --config FILE``: consume requests, schedule them, answer them.

Settings come from the YAML file and ``KVGATE_*`` variables (``settings.py``); invalid settings
exit with status 2 and one line per bad setting. SIGTERM or SIGINT starts the ordered shutdown
(``service.py``), which exits 0; a loop that fails exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiokafka.errors import KafkaError
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvgate.admission_service.kafka_io import KafkaSetupError
from kvgate.admission_service.settings import (
    ServiceSettings,
    TelemetrySettings,
    load_settings,
)
from kvgate.admission_service.tokenizer import TokenizerError
from kvgate.kafka_connection import SettingsError
from kvgate.telemetry.setup import TelemetryConfigError, configure_tracing

log = logging.getLogger("kvgate.admission_service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="settings file (YAML); KVGATE_* override it")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])


def configure_telemetry(settings: TelemetrySettings) -> TracerProvider | None:
    """The process's tracer provider: ``OTEL_*`` variables, the settings' OTLP endpoint and
    service name as defaults, and the JSON-lines spans file when set. Raises
    ``TelemetryConfigError`` for an unusable exporter or protocol (entry points print it)."""
    from kvgate.telemetry.spans_file import JsonLinesSpanExporter  # noqa: PLC0415

    if settings.otlp_endpoint is not None:
        os.environ.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", settings.otlp_endpoint)
    provider = configure_tracing(settings.service_name)
    if provider is not None and settings.spans_file is not None:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(settings.spans_file)))
    return provider


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        settings = load_settings(args.config)
    except SettingsError as exc:
        print(f"kvgate admission-service: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    try:
        provider = configure_telemetry(settings.telemetry)
    except TelemetryConfigError as exc:
        print(f"kvgate admission-service: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(settings))
    except (SettingsError, TokenizerError, KafkaSetupError) as exc:
        print(f"kvgate admission-service: {exc}", file=sys.stderr)
        return 2
    except KafkaError as exc:
        print(f"kvgate admission-service: Kafka is not reachable: {exc}", file=sys.stderr)
        return 1
    finally:
        if provider is not None:
            provider.shutdown()


async def _main(settings: ServiceSettings) -> int:
    from kvgate.admission_service.service import serve  # noqa: PLC0415

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = await serve(settings, stop)
    log.info("stopped (exit %d)", code)
    return code
