"""``kvgate sim WORKLOAD.json``: run a workload against the scheduler and report.

The executor is the deterministic simulator (default) or, with ``--executor real --model DIR``,
the real executor in-process on a checkpoint — same workload format, outputs compared with the
model's unpaged one-request-at-a-time reference. This module is a composition root: the
admission service never imports torch, so the real executor is wired here and imported only when
asked for.

Exit codes: 0 when every non-rejected request finished, nothing leaked, no invariant the
strategy promises broke and outputs match the reference; 1 otherwise; 2 for a bad workload file
or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgate.sim.report import SimReport
from kvgate.sim.simulate import load_strategy, simulate
from kvgate.sim.workload import WorkloadError, load_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", type=Path, help="workload JSON file (docs/workloads.md)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--admission",
        metavar="MODULE:NAME",
        help="an alternative scheduling strategy, e.g. benchmarks.baselines:SeedPreFix",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="skip per-step invariant checks (faster)"
    )
    parser.add_argument(
        "--executor",
        choices=("sim", "real"),
        default="sim",
        help="the simulated executor, or the real one in-process (needs --model)",
    )
    parser.add_argument(
        "--model", type=Path, help="model directory or .gguf file for --executor real"
    )
    parser.add_argument("--device", default="cpu", help="torch device for --executor real")


def _importable_from_here() -> None:
    """Make the current directory importable for ``--admission MODULE:NAME``, as ``python -m``
    does (``benchmarks.baselines`` from the repository root), but after the installed packages,
    so nothing installed is shadowed; not under ``python -P`` / ``PYTHONSAFEPATH``."""
    here = str(Path.cwd())
    if not sys.flags.safe_path and here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def run(args: argparse.Namespace) -> int:
    try:
        workload = load_workload(args.workload)
        if args.admission:
            _importable_from_here()
        strategy = load_strategy(args.admission) if args.admission else None
        if args.executor == "real" and args.model is None:
            raise ValueError("--executor real needs --model DIR_OR_GGUF")
    except (WorkloadError, ValueError, ImportError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    if args.executor == "real":
        from kvgate.sim.real import simulate_real  # noqa: PLC0415 - torch only when asked

        try:
            report = simulate_real(
                workload,
                args.model,
                device=args.device,
                strategy=strategy,
                check=not args.no_check,
            )
        except (ValueError, WorkloadError) as exc:  # CheckpointError is a ValueError
            print(f"kvgate sim: {exc}", file=sys.stderr)
            return 2
    else:
        report = simulate(workload, strategy=strategy, check=not args.no_check)
    return _print(report, as_json=args.json)


def _print(report: SimReport, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(report.to_text())
    return 0 if report.passed else 1
