"""``kvgate gateway``: the OpenAI-compatible HTTP door (docs/gateway.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from kvgate.gateway.server import Gateway
from kvgate.gateway.settings import GatewaySettings, ModelRoute, load_keys
from kvgate.protocol import topics
from kvgate.telemetry.setup import TelemetryConfigError, configure_tracing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True, help="Kafka host:port[,host:port]")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--health-port", type=int, help="/metrics and health without a key")
    parser.add_argument("--open-health", action="store_true", help="same on the API port")
    parser.add_argument("--replica-id", default="gateway-0", help="names its reply topic")
    parser.add_argument("--model", default="kvgate", help="the model name clients send")
    parser.add_argument("--request-topic", default=topics.REQUESTS)
    parser.add_argument("--result-topic", default=topics.RESULTS)
    parser.add_argument("--abort-topic", default=topics.ABORTS)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (streamed text)")
    parser.add_argument("--api-keys-file", type=Path, help="YAML keys file (docs/gateway.md)")
    parser.add_argument("--allow-anonymous", action="store_true", help="no API key needed")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--listen-backlog", type=int, default=2048, help="connections queued before accept"
    )


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    route = ModelRoute(
        name=args.model, request_topic=args.request_topic, result_topic=args.result_topic,
        tokenizer_file=args.tokenizer,
    )  # fmt: skip
    return GatewaySettings(
        bootstrap_servers=args.bootstrap, host=args.host, port=args.port,
        health_port=args.health_port, open_health=args.open_health, replica_id=args.replica_id,
        abort_topic=args.abort_topic, models=[route], keys=load_keys(args.api_keys_file),
        allow_anonymous=args.allow_anonymous, request_timeout_s=args.request_timeout_s,
        listen_backlog=args.listen_backlog,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        settings = settings_from(args)
    except (ValidationError, OSError, ValueError) as exc:
        print(f"kvgate gateway: {exc}", file=sys.stderr)
        return 2
    try:
        provider = configure_tracing("kvgate-gateway")
    except TelemetryConfigError as exc:
        print(f"kvgate gateway: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(settings))
    finally:
        if provider is not None:
            provider.shutdown()  # flushes batched spans


async def _serve(settings: GatewaySettings) -> int:
    gateway = Gateway(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await gateway.start()
    print(
        f"kvgate gateway serving http://{settings.host}:{gateway.port}/v1 "
        f"(health port {gateway.health_port}, replies {settings.reply_topic})",
        flush=True,
    )
    await stop.wait()
    await gateway.close()
    return 0
