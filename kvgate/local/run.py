"""``kvgate run``: the demo's stack, serving ``kvgate.requests`` until Ctrl-C.

Prints the bootstrap address to produce to (``kvgate produce FILE.jsonl --bootstrap ...``) and
the admin API address; results go to ``kvgate.results`` (``kvgate results --bootstrap ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from kvgate.admission_service.cli import configure_telemetry
from kvgate.admission_service.settings import TelemetrySettings
from kvgate.gateway.server import Gateway
from kvgate.gpu_executor.packaged import require_packaged_gguf
from kvgate.local.stack import LocalStack, StackOptions, local_gateway_settings
from kvgate.protocol import topics
from kvgate.telemetry.setup import TelemetryConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=Path("kvgate-demo-out"))
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model-dir", type=Path, help="an existing model (default: a tiny one)")
    model.add_argument("--model", type=Path, help="a llama GGUF file (converted once, cached)")
    model.add_argument(
        "--smollm2", action="store_true", help="the packaged SmolLM2-135M-Instruct (real text)"
    )
    parser.add_argument("--threads", type=int, default=2, help="executor torch threads")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the executor's batch-invariant mode: a request's tokens and logprobs do not "
        "depend on what it is batched with",
    )
    parser.add_argument("--family", choices=["llama", "looped"], default="llama")
    parser.add_argument("--port", type=int, help="Kafka port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--num-blocks", type=int, default=256, help="executor KV cache blocks")
    parser.add_argument("--token-topic", action="store_true", help="also stream tokens")
    parser.add_argument(
        "--gateway", action="store_true", help="also serve the OpenAI API (no key, loopback)"
    )
    parser.add_argument("--gateway-port", type=int, default=8000, help="its port (0: a free one)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        provider = configure_telemetry(
            TelemetrySettings(service_name="kvgate-run", spans_file=args.out_dir / "spans.jsonl")
        )
    except TelemetryConfigError as exc:
        print(f"kvgate run: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"kvgate run: {exc}", file=sys.stderr)
        return 2
    finally:
        if provider is not None:
            provider.shutdown()


async def _serve(args: argparse.Namespace) -> int:
    gguf = require_packaged_gguf() if args.smollm2 else args.model
    options = StackOptions(
        out_dir=args.out_dir,
        model_dir=args.model_dir,
        model_gguf=gguf,
        executor_threads=args.threads,
        executor_batch_invariant=args.batch_invariant,
        family=args.family,
        num_blocks=args.num_blocks,
        broker_port=args.port,
        max_num_seqs=32,
    )
    overrides: dict[str, dict[str, object]] = {"telemetry": {"model_name": _model_name(args)}}
    if args.token_topic:
        overrides["kafka"] = {"token_topic": topics.TOKENS}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LocalStack(options, **overrides) as stack:
        service = stack.service
        assert service is not None
        admin = service.settings.admin
        where = f"token in {admin.token_file}" if admin.token_file else "no admin token"
        print(
            f"\nkvgate is serving.\n"
            f"  Kafka bootstrap   {stack.bootstrap}\n"
            f"  requests topic    {service.settings.kafka.request_topic}\n"
            f"  results topic     {service.settings.kafka.result_topic}\n"
            f"  admin API         http://127.0.0.1:{service.admin_port} ({where})\n"
            f"  produce:  kvgate produce FILE.jsonl --bootstrap {stack.bootstrap}\n"
            f"  results:  kvgate results --bootstrap {stack.bootstrap} --from-beginning\n"
            f"Ctrl-C to stop.\n",
            flush=True,
        )
        gateway = None
        if args.gateway:
            settings = local_gateway_settings(service.settings, stack.bootstrap, args.gateway_port)
            gateway = Gateway(settings)
            await gateway.start()
            print(
                f"  OpenAI API        http://127.0.0.1:{gateway.port}/v1 "
                f"(model {service.settings.telemetry.model_name}, no key)\n",
                flush=True,
            )
        try:
            stopping = asyncio.create_task(stop.wait())
            failing = asyncio.create_task(service.failed.wait())
            await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            failing.cancel()
        finally:
            if gateway is not None:
                await gateway.close()
        return 1 if service.failure is not None else 0


def _model_name(args: argparse.Namespace) -> str:
    """What clients call the model (the gateway's ``model``, the spans' gen_ai.request.model)."""
    if args.smollm2:
        return "SmolLM2-135M-Instruct"
    if args.model is not None:
        return Path(args.model).stem
    if args.model_dir is not None:
        return Path(args.model_dir).name
    return "kvgate"  # the tiny random model
