"""``kvgate produce FILE.jsonl`` and ``kvgate results``: a client for any Kafka.

Connection settings come from ``--bootstrap`` or from the ``kafka`` section of a service
settings file (``--config``: TLS and SASL included). ``produce`` sends each non-blank line of
the file as one record, keyed by its ``request_id`` when the line is a JSON object that has one,
with a W3C ``traceparent`` header when tracing is configured (``OTEL_*``); it does not validate
— the service does, and dead-letters what it cannot use. ``results`` prints one JSON line per
result (read_committed), or per token chunk with ``--tokens``, optionally stopping after
``--count`` of them or ``--timeout-s``; each is printed once (``first_copies.py``: a result by
its request id, a chunk by its request id, choice and index) unless ``--keep-copies``.

Both give up on a broker they cannot reach within ``--connect-timeout-s`` (default 10 s; each
Kafka request within ``--request-timeout-s``, by default the settings' 30 s) and say so in one
line, exit code 1; a malformed ``--bootstrap`` is exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from kvgate.admission_service.settings import KafkaSettings, load_settings
from kvgate.client.first_copies import FirstCopies
from kvgate.kafka_connection import SettingsError, client_options
from kvgate.protocol import topics
from kvgate.protocol.records import (
    REPLY_KIND_TOKENS,
    TRACEPARENT_HEADER,
    reply_kind,
    token_chunks_of,
)
from kvgate.telemetry.context import traceparent_of
from kvgate.telemetry.setup import TelemetryConfigError

DEFAULT_CONNECT_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """The broker could not be reached or stopped answering; the message says which and why."""


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="host:port[,host:port] (default 127.0.0.1:9092)")
    parser.add_argument("--config", type=Path, help="service settings file: its kafka section")
    parser.add_argument("--topic", help="topic (default: the settings' or kvgate's default)")
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help=f"give up reaching the broker after this long (default {DEFAULT_CONNECT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        help="each Kafka request's timeout, at least 1 (default: the settings', 30)",
    )


def _kafka(args: argparse.Namespace) -> KafkaSettings:
    overrides: dict[str, Any] = {}
    if args.bootstrap:
        _check_bootstrap(args.bootstrap)
        overrides["bootstrap_servers"] = args.bootstrap
    elif args.config is None:
        overrides["bootstrap_servers"] = "127.0.0.1:9092"
    if args.request_timeout_s is not None:
        if args.request_timeout_s < 1:
            raise SettingsError(
                f"--request-timeout-s must be at least 1, got {args.request_timeout_s:g}"
            )
        overrides["request_timeout_ms"] = round(args.request_timeout_s * 1000)
    if args.connect_timeout_s <= 0:
        raise SettingsError(f"--connect-timeout-s must be positive, got {args.connect_timeout_s:g}")
    settings = load_settings(args.config, {"kafka": overrides} if overrides else None)
    return settings.kafka


def _check_bootstrap(servers: str) -> None:
    for server in servers.split(","):
        host, _, port = server.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(f"--bootstrap: {server!r} is not host:port")


@contextlib.contextmanager
def _quiet_connection_errors() -> Iterator[None]:
    """While connecting, aiokafka logs every refused connection; the command reports the one
    failure itself, so those lines are held back (later warnings still show)."""
    logger = logging.getLogger("aiokafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


async def _start(
    client: AIOKafkaProducer | AIOKafkaConsumer, kafka: KafkaSettings, timeout_s: float
) -> None:
    """Start a client within ``timeout_s``, or stop it and raise :class:`Unreachable`."""
    where = f"Kafka at {kafka.bootstrap_servers}"
    try:
        with _quiet_connection_errors():
            async with asyncio.timeout(timeout_s):
                await client.start()
    except TimeoutError:
        await client.stop()
        raise Unreachable(f"{where} did not answer within {timeout_s:g} s") from None
    except KafkaConnectionError:
        await client.stop()
        raise Unreachable(f"cannot reach {where}: no bootstrap server answered") from None
    except (KafkaError, OSError) as exc:
        await client.stop()
        raise Unreachable(f"cannot reach {where}: {exc}") from None


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

    try:
        provider = configure_telemetry(TelemetrySettings(service_name="kvgate-produce"))
    except TelemetryConfigError as exc:
        print(f"kvgate produce: {exc}", file=sys.stderr)
        return 2
    topic = args.topic or kafka.request_topic
    try:
        count = asyncio.run(_produce(kafka, topic, lines, args.connect_timeout_s))
    except Unreachable as exc:
        print(f"kvgate produce: {exc}", file=sys.stderr)
        return 1
    finally:
        if provider is not None:
            provider.shutdown()
    print(f"produced {count} records to {topic}")
    return 0


async def _produce(
    kafka: KafkaSettings, topic: str, lines: list[bytes], connect_timeout_s: float
) -> int:
    producer = AIOKafkaProducer(**client_options(kafka), acks="all", enable_idempotence=False)
    await _start(producer, kafka, connect_timeout_s)
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
    except KafkaError as exc:  # a request timed out, or the broker refused the records
        raise Unreachable(
            f"producing to {topic} on {kafka.bootstrap_servers} failed: {exc}"
        ) from None
    finally:
        await producer.stop()
    return len(lines)


# ----------------------------------------------------------------------------------- results


def add_results_arguments(parser: argparse.ArgumentParser) -> None:
    _connection_arguments(parser)
    parser.add_argument("--from-beginning", action="store_true", help="not only new results")
    parser.add_argument("--count", type=int, help="stop after this many results")
    parser.add_argument("--timeout-s", type=float, help="stop after this long")
    parser.add_argument(
        "--tokens", action="store_true",
        help=f"the token stream instead (kafka.token_topic, else {topics.TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--keep-copies", action="store_true",
        help="print every copy (default: a result once per request id, a token chunk once per "
        "request id, choice and index)",
    )  # fmt: skip


def run_results(args: argparse.Namespace) -> int:
    try:
        kafka = _kafka(args)
    except SettingsError as exc:
        print(f"kvgate results: {exc}", file=sys.stderr)
        return 2
    stream = kafka.token_topic or topics.TOKENS
    topic = args.topic or (stream if args.tokens else kafka.result_topic)
    try:
        return asyncio.run(_follow(kafka, topic, args))
    except Unreachable as exc:
        print(f"kvgate results: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _values(headers: Sequence[tuple[str, bytes]], value: bytes) -> list[bytes]:
    """What one record prints: a line per token chunk of a record of a step's chunks (header
    ``kvgate-reply-kind: tokens``), else the value as it is."""
    kind = reply_kind(headers)
    if kind != REPLY_KIND_TOKENS:
        return [value]
    try:
        chunks = token_chunks_of(kind, value)
    except ValidationError:
        return [value]  # printed as it is, for whoever reads the lines to judge
    return [chunk.model_dump_json().encode() for chunk in chunks]


async def _follow(kafka: KafkaSettings, topic: str, args: argparse.Namespace) -> int:
    consumer = AIOKafkaConsumer(
        topic,
        **client_options(kafka),
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest" if args.from_beginning else "latest",
    )
    await _start(consumer, kafka, args.connect_timeout_s)
    seen = 0
    firsts = FirstCopies()
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
                    for value in _values(message.headers, message.value):
                        if not args.keep_copies and not firsts.first(value):
                            continue
                        sys.stdout.write(value.decode("utf-8", errors="replace") + "\n")
                        seen += 1
            sys.stdout.flush()
    except KafkaError as exc:
        raise Unreachable(f"reading {topic} on {kafka.bootstrap_servers} failed: {exc}") from None
    finally:
        await consumer.stop()
    if args.count is not None and seen < args.count:
        print(f"kvgate results: {seen} of {args.count} results before the timeout", file=sys.stderr)
        return 1
    return 0
