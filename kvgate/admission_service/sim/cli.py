"""``kvgate sim WORKLOAD.json``: run a workload on the simulated executor and report.

Exit codes: 0 when every non-rejected request finished, nothing leaked, no invariant broke and
outputs match the reference; 1 otherwise; 2 for a bad workload file or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgate.admission_service.sim.simulate import load_strategy, simulate
from kvgate.admission_service.sim.workload import WorkloadError, load_workload


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


def run(args: argparse.Namespace) -> int:
    try:
        workload = load_workload(args.workload)
        strategy = load_strategy(args.admission) if args.admission else None
    except (WorkloadError, ValueError, ImportError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    report = simulate(workload, strategy=strategy, check=not args.no_check)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(report.to_text())
    return 0 if report.passed else 1
