"""The ``kvgate`` command line: one subcommand per entry point.

Subcommands live next to the code they run and are imported only when chosen, so ``kvgate sim``
never imports torch and ``kvgate --help`` starts fast. A command module exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the process exit code). A command whose extra
is not installed (``kvgate demo`` without ``kvgate[demo]``) says which to install, in one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

import kvgate
from kvgate.extras import MissingExtra, extra_for, require

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("kvgate.sim.command", "run a workload file on the simulated or a real executor"),
    "replay": ("kvgate.sim.replay_command", "replay a window of the request log in the simulator"),
    "executor": ("kvgate.executor.cli", "serve a model's step plans over a WebSocket"),
    "make-tiny-model": ("kvgate.executor.tiny_model", "write a small random checkpoint"),
    "convert": (
        "kvgate.executor.gguf_checkpoint",
        "write a GGUF file (llama, qwen2, qwen3, gemma2, gemma3, phi3) as a Hugging Face directory",
    ),
    "admission-service": (
        "kvgate.admission_service.cli",
        "consume requests from Kafka, schedule them over executors, answer them",
    ),
    "sim-executor": (
        "kvgate.sim.server",
        "serve the simulated executor over the WebSocket step protocol",
    ),
    "demo": (
        "kvgate.local.demo",
        "run broker, executor and admission service here, push a workload through, report",
    ),
    "run": (
        "kvgate.local.run",
        "run broker, executor and admission service here, serving until Ctrl-C",
    ),
    "gateway": ("kvgate.gateway.cli", "serve the OpenAI-compatible HTTP API over Kafka"),
    "batch-feeder": (
        "kvgate.gateway.batch_cli",
        "feed batches (/v1/batches) to Kafka without serving HTTP (its own Deployment)",
    ),
    "produce": ("kvgate.client.produce", "produce requests from a JSON-lines file"),
    "results": ("kvgate.client.results", "print results as JSON lines"),
    "operator": ("kvgate.operator.cli", "run the ExecutorPool operator (kopf)"),
}

# command -> the extra (pyproject.toml) it cannot start without
NEEDS_EXTRA: dict[str, str] = {
    "executor": "executor",
    "make-tiny-model": "executor",
    "demo": "demo",
    "run": "demo",
    "operator": "operator",
}


class _CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _CommandModule:
    if name in NEEDS_EXTRA:
        require(NEEDS_EXTRA[name], f"kvgate {name}")
    module_name, _ = COMMANDS[name]
    try:
        return cast(_CommandModule, importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        missing = extra_for(exc, f"kvgate {name}")
        if missing is None:
            raise
        raise missing from exc


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvgate {kvgate.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:
            _load(name).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(args_list).parse_args(args_list)
        command = _load(args.command)
        try:
            return command.run(args)
        except ModuleNotFoundError as exc:  # e.g. `kvgate sim --executor real` without torch
            missing = extra_for(exc, f"kvgate {args.command}")
            if missing is None:
                raise
            raise missing from exc
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
