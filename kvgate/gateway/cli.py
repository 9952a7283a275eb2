"""``kvgate gateway``: the OpenAI-compatible HTTP door (docs/gateway.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiokafka.errors import KafkaError
from pydantic import ValidationError

from kvgate.gateway.batch_flags import add_batch_arguments, batch_settings_from
from kvgate.gateway.server import Gateway
from kvgate.gateway.settings import GatewaySettings, ModelRoute, load_keys
from kvgate.kafka_connection import KafkaConnection, SettingsError
from kvgate.protocol import topics
from kvgate.protocol.enums import SaslMechanism, SecurityProtocol
from kvgate.telemetry.setup import TelemetryConfigError, configure_tracing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True, help="Kafka host:port[,host:port]")
    add_kafka_security(parser.add_argument_group("Kafka security (as the admission service's)"))
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
    parser.add_argument(
        "--rate-limit-replicas", type=int, default=1,
        help="replicas sharing each API key's rate limit: each enforces 1/N of it",
    )  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=2**20, help="413 above")
    parser.add_argument(
        "--head-timeout-s", type=float, default=10.0, help="a request's headers (from byte one)"
    )
    parser.add_argument(
        "--body-timeout-s", type=float, default=30.0, help="a request's body (408 after)"
    )
    add_batch_arguments(parser, feeder_flag=True)


def add_kafka_security(group: argparse._ArgumentGroup) -> None:
    protocols = [p.value for p in SecurityProtocol]
    group.add_argument("--kafka-security-protocol", choices=protocols, default="PLAINTEXT")
    group.add_argument("--kafka-sasl-mechanism", choices=[m.value for m in SaslMechanism])
    group.add_argument("--kafka-sasl-username")
    group.add_argument(
        "--kafka-sasl-password-file", type=Path, help="the SASL password (a mounted Secret)"
    )
    group.add_argument("--kafka-ssl-cafile", type=Path, help="CA bundle the broker is checked by")
    group.add_argument("--kafka-ssl-certfile", type=Path, help="client certificate (mutual TLS)")
    group.add_argument("--kafka-ssl-keyfile", type=Path, help="its private key")
    group.add_argument(
        "--kafka-no-hostname-check", action="store_true",
        help="do not check the broker's certificate names the host dialled",
    )  # fmt: skip


def kafka_from(args: argparse.Namespace) -> KafkaConnection:
    return KafkaConnection(
        bootstrap_servers=args.bootstrap, client_id=f"kvgate-gateway-{args.replica_id}",
        security_protocol=args.kafka_security_protocol, sasl_mechanism=args.kafka_sasl_mechanism,
        sasl_username=args.kafka_sasl_username, sasl_password_file=args.kafka_sasl_password_file,
        ssl_cafile=args.kafka_ssl_cafile, ssl_certfile=args.kafka_ssl_certfile,
        ssl_keyfile=args.kafka_ssl_keyfile, ssl_check_hostname=not args.kafka_no_hostname_check,
    )  # fmt: skip


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    route = ModelRoute(
        name=args.model, request_topic=args.request_topic, result_topic=args.result_topic,
        tokenizer_file=args.tokenizer,
    )  # fmt: skip
    return GatewaySettings(
        kafka=kafka_from(args), host=args.host, port=args.port,
        health_port=args.health_port, open_health=args.open_health, replica_id=args.replica_id,
        abort_topic=args.abort_topic, models=[route], keys=load_keys(args.api_keys_file),
        allow_anonymous=args.allow_anonymous, request_timeout_s=args.request_timeout_s,
        listen_backlog=args.listen_backlog, rate_limit_replicas=args.rate_limit_replicas,
        max_body_bytes=args.max_body_bytes, head_timeout_s=args.head_timeout_s,
        body_timeout_s=args.body_timeout_s, batches=batch_settings_from(args),
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
    try:
        await gateway.start()
    except (KafkaError, SettingsError, OSError) as exc:
        # A broker that is down, refuses the TLS handshake (an untrusted certificate) or the
        # SASL credentials, or a credentials file that cannot be read: one line, exit 1.
        print(f"kvgate gateway: cannot use Kafka at {settings.kafka.describe()}: {exc!r}",
              file=sys.stderr, flush=True)  # fmt: skip
        await gateway.close()
        return 1
    print(
        f"kvgate gateway serving http://{settings.host}:{gateway.port}/v1 "
        f"(health port {gateway.health_port}, replies {settings.reply_topic})",
        flush=True,
    )
    await stop.wait()
    await gateway.close()
    return 0
