"""``kvgate produce FILE.jsonl`` and ``kvgate results``: a client for any Kafka.

Connection settings come from ``--bootstrap`` or from the ``kafka`` section of a service
settings file (``--config``: TLS and SASL included). ``produce`` sends each non-blank line of
the file as one record, keyed by its ``request_id`` when the line is a JSON object that has one,
with a W3C ``traceparent`` header when tracing is configured (``OTEL_*``); it does not validate
— the service does, and dead-letters what it cannot use. ``results`` prints one JSON line per
result (read_committed), optionally stopping after ``--count`` results or ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from kvgate.admission_service.kafka_io import client_options
from kvgate.admission_service.settings import KafkaSettings, SettingsError, load_settings
from kvgate.protocol.records import TRACEPARENT_HEADER
from kvgate.telemetry.context import traceparent_of


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="host:port[,host:port] (default 127.0.0.1:9092)")
    parser.add_argument("--config", type=Path, help="service settings file: its kafka section")
    parser.add_argument("--topic", help="topic (default: the settings' or kvgate's default)")


def _kafka(args: argparse.Namespace) -> KafkaSettings:
    overrides: dict[str, Any] = {}
    if args.bootstrap:
        overrides["bootstrap_servers"] = args.bootstrap
    elif args.config is None:
        overrides["bootstrap_servers"] = "127.0.0.1:9092"
    settings = load_settings(args.config, {"kafka": overrides} if overrides else None)
    return settings.kafka


def _key(line: bytes) -> bytes | None:
    try:
        body = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    rid = body.get("request_id") if isinstance(body, dict) else None
    return rid.encode() if isinstance(rid, str) and rid else None


# ----------------------------------------------------------------------------------- produce


def add_produce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="JSON lines: one InferenceRequest per line")
    _connection_arguments(parser)


def run_produce(args: argparse.Namespace) -> int:
    try:
        kafka = _kafka(args)
        lines = [line for line in args.file.read_bytes().splitlines() if line.strip()]
    except (SettingsError, OSError) as exc:
        print(f"kvgate produce: {exc}", file=sys.stderr)
        return 2
    from kvgate.admission_service.cli import configure_telemetry  # noqa: PLC0415
    from kvgate.admission_service.settings import TelemetrySettings  # noqa: PLC0415

    provider = configure_telemetry(TelemetrySettings(service_name="kvgate-produce"))
    try:
        count = asyncio.run(_produce(kafka, args.topic or kafka.request_topic, lines))
    finally:
        if provider is not None:
            provider.shutdown()
    print(f"produced {count} records to {args.topic or kafka.request_topic}")
    return 0


async def _produce(kafka: KafkaSettings, topic: str, lines: list[bytes]) -> int:
    producer = AIOKafkaProducer(**client_options(kafka), acks="all", enable_idempotence=False)
    await producer.start()
    tracer = trace.get_tracer("kvgate.produce")
    try:
        futures = []
        for line in lines:
            with tracer.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER) as span:
                context = span.get_span_context()
                headers = (
                    [(TRACEPARENT_HEADER, traceparent_of(context).encode())]
                    if context.is_valid
                    else None
                )
                futures.append(await producer.send(topic, line, key=_key(line), headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return len(lines)


# ----------------------------------------------------------------------------------- results


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    _connection_arguments(parser)
    parser.add_argument("--from-beginning", action="store_true", help="not only new results")
    parser.add_argument("--count", type=int, help="stop after this many results")
    parser.add_argument("--timeout-s", type=float, help="stop after this long")


def run_results(args: argparse.Namespace) -> int:
    try:
        kafka = _kafka(args)
    except SettingsError as exc:
        print(f"kvgate results: {exc}", file=sys.stderr)
        return 2
    topic = args.topic or kafka.result_topic
    try:
        return asyncio.run(_follow(kafka, topic, args))
    except KeyboardInterrupt:
        return 0


async def _follow(kafka: KafkaSettings, topic: str, args: argparse.Namespace) -> int:
    consumer = AIOKafkaConsumer(
        topic,
        **client_options(kafka),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest" if args.from_beginning else "latest",
    )
    await consumer.start()
    seen = 0
    deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
    try:
        while args.count is None or seen < args.count:
            if deadline is not None and time.monotonic() > deadline:
                break
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                for message in messages:
                    if message.value is None:
                        continue
                    sys.stdout.write(message.value.decode("utf-8", errors="replace") + "\n")
                    seen += 1
            sys.stdout.flush()
    finally:
        await consumer.stop()
    if args.count is not None and seen < args.count:
        print(f"kvgate results: {seen} of {args.count} results before the timeout", file=sys.stderr)
        return 1
    return 0
