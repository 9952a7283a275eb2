"""``kvgate executor --model DIR``: load a model, allocate its KV cache, serve step plans.

The bearer token comes from ``KVGATE_EXECUTOR_TOKEN`` or ``--token-file`` (a mounted Kubernetes
Secret); without one the executor refuses to start. ``OTEL_*`` variables configure tracing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from kvgate.gpu_executor.exit_policy import ExitPolicy
from kvgate.gpu_executor.kv_cache import DEFAULT_BLOCK_SIZE
from kvgate.gpu_executor.loader import DType

if TYPE_CHECKING:
    from kvgate.gpu_executor.server import ExecutorServer

TOKEN_ENV = "KVGATE_EXECUTOR_TOKEN"
log = logging.getLogger("kvgate.executor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="Hugging Face model directory or llama-architecture .gguf file",
    )
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--dtype", choices=[d.value for d in DType], default=DType.AUTO.value)
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--num-blocks", type=int, help="KV cache blocks (required on CPU)")
    sizing.add_argument(
        "--memory-fraction",
        type=float,
        help="GPU memory share for weights, activations and KV (default 0.9 on GPU)",
    )
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--host-snapshot-blocks", type=int, default=0)
    parser.add_argument(
        "--exit-policy",
        choices=[p.value for p in ExitPolicy],
        default=ExitPolicy.GATE.value,
        help="exit rule of looped models (requests with an exit_trace replay it)",
    )
    parser.add_argument("--executor-id", default=os.environ.get("HOSTNAME", "executor-0"))
    parser.add_argument("--token-file", type=Path, help=f"bearer token file (else ${TOKEN_ENV})")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip measuring host bandwidth and prefill cost at startup",
    )


def _cuda() -> bool:
    import torch  # noqa: PLC0415 — keep `kvgate --help` free of torch

    return bool(torch.cuda.is_available())


def read_token(token_file: Path | None) -> str:
    if token_file is not None:
        token = token_file.read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no bearer token: set ${TOKEN_ENV} or pass --token-file")
    return token


def run(args: argparse.Namespace) -> int:
    from kvgate.gpu_executor.executor import Executor  # noqa: PLC0415
    from kvgate.gpu_executor.server import ExecutorServer  # noqa: PLC0415
    from kvgate.telemetry.setup import configure_tracing  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    memory_fraction = args.memory_fraction
    if args.num_blocks is None and memory_fraction is None:
        if args.device == "cpu":
            log.error("--num-blocks is required on CPU")
            return 2
        memory_fraction = 0.9
    provider = configure_tracing("kvgate-executor")

    def load() -> Executor:
        executor = Executor(
            args.model,
            num_blocks=args.num_blocks,
            memory_fraction=memory_fraction,
            device=args.device,
            dtype=DType(args.dtype),
            host_snapshot_blocks=args.host_snapshot_blocks,
            executor_id=args.executor_id,
            block_size=args.block_size,
            exit_policy=ExitPolicy(args.exit_policy),
        )
        if not args.no_calibrate:
            executor.calibrate()
        return executor

    server = ExecutorServer(load, token)
    try:
        return asyncio.run(_serve(server, args.host, args.port))
    finally:
        if provider is not None:
            provider.shutdown()


async def _serve(server: ExecutorServer, host: str, port: int) -> int:
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("listening on %s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loading = asyncio.create_task(server.wait_loaded())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and loading.exception() is not None:
            log.error("model load failed: %s", loading.exception())
            return 1
        await stopping
        log.info("shutting down")
        return 0
    finally:
        loading.cancel()
        stopping.cancel()
        await runner.cleanup()
