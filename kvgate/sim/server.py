"""``kvgate sim-executor``: a simulated executor behind the real WebSocket step protocol.

The same server as ``kvgate executor`` (:mod:`kvgate.step_server`: bearer token, epoch fencing
with a reset per accepted session, results in plan order, health, readiness, metrics), with the
deterministic simulated model instead of weights: integration tests and benchmarks use it where
the model is not the point, and it starts in a fraction of a second without torch.

``--step-time-ms`` makes every step take at least that long (an executor under load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from pydantic import ValidationError

from kvgate.protocol.tokenizer_files import TokenizerFiles
from kvgate.sim.backend import (
    SimBackend,
    SimExecutorConfig,
    add_config_arguments,
    config_from_arguments,
)
from kvgate.step_server.server import TOKEN_ENV, StepServer, read_token, serve

log = logging.getLogger("kvgate.sim_executor")


def sim_step_server(backend: SimBackend, token: str, *, step_time_s: float = 0.0) -> StepServer:
    """The shared step server over a simulated backend (ready at once: there is nothing to load)."""
    return StepServer(
        lambda: backend,
        token,
        fence=backend.fence,
        before_step=backend.wait_released,
        min_step_time_s=step_time_s,
    )


def read_tokenizer_files(tokenizer_json: Path) -> TokenizerFiles:
    """A ``tokenizer.json`` and the ``tokenizer_config.json`` beside it (if any)."""
    config_file = tokenizer_json.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    return TokenizerFiles.of(tokenizer_json.read_text(), config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimExecutorConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--executor-id", default=defaults.executor_id)
    parser.add_argument("--token-file", type=Path, help=f"bearer token file (else ${TOKEN_ENV})")
    add_config_arguments(parser)
    parser.add_argument("--step-time-ms", type=float, default=0.0)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json to serve at /v1/tokenizer (tokenizer_config.json beside it too)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    try:
        config = config_from_arguments(args, executor_id=args.executor_id)
    except ValidationError as exc:
        log.error("invalid simulated executor: %s", exc)
        return 2
    backend = SimBackend(config)
    if args.tokenizer is not None:
        try:
            backend.tokenizer_files = read_tokenizer_files(args.tokenizer)
        except (OSError, ValueError) as exc:
            log.error("--tokenizer %s: %s", args.tokenizer, exc)
            return 2
    server = sim_step_server(backend, token, step_time_s=args.step_time_ms / 1000)
    return asyncio.run(serve(server, args.host, args.port))
