"""``kvgate batch-feeder``: a batch feeder without the HTTP API, for a Deployment of its own
(docs/batch.md, "Where the feeder runs"). Its flags are the gateway's Kafka, model and batch
flags (``batch_flags.py``), and a health port for its probes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from kvgate.admission_service.tokenizer import load_tokenizer
from kvgate.batch.feeder import BatchFeeder
from kvgate.batch.store import open_store
from kvgate.batch.topics import BatchTopicError
from kvgate.gateway import cli as gateway_cli
from kvgate.gateway.batch_flags import add_batch_arguments, batch_settings_from
from kvgate.gateway.settings import ModelRoute
from kvgate.kafka_connection import SettingsError
from kvgate.protocol import topics
from kvgate.web.guard import GuardedRunner, HttpLimits, guarded_app, plain_text_refusal

# ---------------------------------------------------------------------- kvgate batch-feeder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True, help="Kafka host:port[,host:port]")
    gateway_cli.add_kafka_security(parser.add_argument_group("Kafka security"))
    parser.add_argument(
        "--replica-id", default="batch-feeder-0", help="its name in the feeder group"
    )
    parser.add_argument("--model", default="kvgate", help="the model name batch lines send")
    parser.add_argument("--request-topic", default=topics.REQUESTS)
    parser.add_argument("--result-topic", default=topics.RESULTS)
    parser.add_argument("--abort-topic", default=topics.ABORTS)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (completions' text)")
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--health-port", type=int, default=8001, help="/healthz, /readyz")
    add_batch_arguments(parser, feeder_flag=False)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        batches = batch_settings_from(args)
        kafka = gateway_cli.kafka_from(args)
        route = ModelRoute(
            name=args.model, request_topic=args.request_topic, result_topic=args.result_topic,
            tokenizer_file=args.tokenizer,
        )  # fmt: skip
    except (ValidationError, OSError, ValueError) as exc:
        print(f"kvgate batch-feeder: {exc}", file=sys.stderr)
        return 2
    if batches is None:
        print("kvgate batch-feeder: name a store (--batch-store)", file=sys.stderr)
        return 2
    codec = load_tokenizer(route.tokenizer_file) if route.tokenizer_file else None
    store = open_store(batches.store)
    feeder = BatchFeeder(
        kafka=kafka, settings=batches, routes=[route], codecs={route.name: codec},
        abort_topic=args.abort_topic, default_max_tokens=args.default_max_tokens, store=store,
    )  # fmt: skip
    return asyncio.run(_serve(feeder, args.host, args.health_port))


async def _serve(feeder: BatchFeeder, host: str, health_port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await feeder.start()
    except (KafkaError, SettingsError, BatchTopicError, OSError) as exc:
        print(f"kvgate batch-feeder: cannot start: {exc!r}", file=sys.stderr, flush=True)
        await feeder.close()
        return 1
    runner = await _health(feeder, host, health_port)
    print(f"kvgate batch-feeder feeding (health port {health_port})", flush=True)
    await stop.wait()
    await runner.cleanup()
    await feeder.close()
    return 0


async def _health(feeder: BatchFeeder, host: str, port: int) -> web.AppRunner:
    limits = HttpLimits()

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if feeder.failure is None:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready"}, status=503)

    app = guarded_app(limits, plain_text_refusal)
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = GuardedRunner(app, limits, plain_text_refusal, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
