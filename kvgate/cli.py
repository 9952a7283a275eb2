"""The ``kvgate`` command line: one subcommand per entry point.

Subcommands live next to the code they run and are imported only when chosen, so ``kvgate sim``
never imports torch and ``kvgate --help`` starts fast. A command module exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the process exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("kvgate.sim_command", "run a workload file on the simulated or a real executor"),
    "executor": ("kvgate.gpu_executor.cli", "serve a model's step plans over a WebSocket"),
    "make-tiny-model": ("kvgate.gpu_executor.tiny_model", "write a small random checkpoint"),
    "convert": (
        "kvgate.gpu_executor.gguf_checkpoint",
        "write a llama-architecture GGUF file as a Hugging Face model directory",
    ),
    "admission-service": (
        "kvgate.admission_service.cli",
        "consume requests from Kafka, schedule them over executors, answer them",
    ),
    "sim-executor": (
        "kvgate.admission_service.sim_server",
        "serve the simulated executor over the WebSocket step protocol",
    ),
    "demo": (
        "kvgate.admission_service.demo",
        "run broker, executor and admission service here, push a workload through, report",
    ),
    "run": (
        "kvgate.admission_service.run_cli",
        "run broker, executor and admission service here, serving until Ctrl-C",
    ),
    "produce": ("kvgate.admission_service.produce_cli", "produce requests from a JSON-lines file"),
    "results": ("kvgate.admission_service.results_cli", "print results as JSON lines"),
    "operator": ("kvgate.operator.cli", "run the ExecutorPool operator (kopf)"),
}


class _CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _CommandModule:
    module_name, _ = COMMANDS[name]
    return cast(_CommandModule, importlib.import_module(module_name))


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:
            _load(name).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
    return _load(args.command).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
