"""The livelock suite under kvgate and three other admission rules, side by side.

    python benchmarks/bench_livelock.py [--json] [--causes] [--growth-reserve-steps K]

For every case: finished requests, executor steps, preemptions, recomputed tokens and the largest
audited bypass count, for kvgate, the seed's pre-fix and post-fix rules and a vLLM-style rule
(benchmarks/baselines.py). Ratios are against the post-fix rule measured in the same run; cases
where the post-fix rule did not drain are reported as such and left out of its ratios.
``--causes`` adds kvgate's preemptions tallied by cause (benchmarks/preemption_causes.py);
``--growth-reserve-steps`` runs kvgate with another growth reserve (0 turns it off).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baselines import SeedPostFix, SeedPreFix, VllmStyle
from benchmarks.preemption_causes import CauseRecorder
from kvgate.admission_service.scheduler.strategy import KvgateStrategy
from kvgate.sim.report import SimReport
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import Workload
from kvgate.sim.workloads import livelock_suite

STRATEGIES = (KvgateStrategy, SeedPreFix, SeedPostFix, VllmStyle)


def _cell(report: SimReport) -> str:
    stall = " STALL" if report.stalled else ""
    return (
        f"{report.finished:>2}/{report.total} {report.steps:>4} {report.preemptions:>4} "
        f"{report.recomputed_tokens:>4} {report.max_bypasses:>3}{stall}"
    )


def _with_reserve(workload: Workload, steps: int | None) -> Workload:
    if steps is None:
        return workload
    scheduler = workload.scheduler.model_copy(update={"growth_reserve_steps": steps})
    return workload.model_copy(update={"scheduler": scheduler})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--causes", action="store_true", help="tally kvgate's preemptions")
    parser.add_argument(
        "--growth-reserve-steps", type=int, default=None, help="kvgate's growth reserve (≥ 0)"
    )
    args = parser.parse_args()
    if args.growth_reserve_steps is not None and args.growth_reserve_steps < 0:
        parser.error("--growth-reserve-steps must be >= 0")
    rows = []
    causes: dict[str, Counter[str]] = {}
    first_token: dict[str, dict[int, list[int]]] = {}  # pricing -> priority -> steps
    for name, workload in livelock_suite():
        reports = {}
        for strategy_type in STRATEGIES:
            ours = strategy_type is KvgateStrategy
            run_on = _with_reserve(workload, args.growth_reserve_steps) if ours else workload
            strategy = CauseRecorder() if ours else strategy_type()
            reports[strategy.name] = simulate(run_on, strategy=strategy, audit=True)
            if isinstance(strategy, CauseRecorder):
                pricing = name.split("-")[0]
                causes.setdefault(pricing, Counter()).update(strategy.causes)
                by_priority = first_token.setdefault(pricing, {})
                for priority, steps in strategy.first_token_steps.values():
                    by_priority.setdefault(priority, []).append(steps)
        rows.append((name, reports))
    if args.json:
        out = {name: {k: r.to_json() for k, r in reports.items()} for name, reports in rows}
        print(json.dumps(out, indent=2))
        return 0
    header = "fin/total steps preempt recomputed maxbyp"
    print(f"{'case':<44}" + "".join(f" | {s.name:<26}" for s in STRATEGIES))
    print(f"{'':<44}" + "".join(f" | {header[:26]:<26}" for _ in STRATEGIES))
    for name, reports in rows:
        print(f"{name:<44}" + "".join(f" | {_cell(reports[s.name]):<26}" for s in STRATEGIES))
    print()
    for pricing in ("fill", "first_chunk"):
        subset = [(n, r) for n, r in rows if n.startswith(pricing + "-")]
        kv = [r["kvgate"] for _, r in subset]
        post = [r["seed-post-fix"] for _, r in subset]
        pre = [r["seed-pre-fix"] for _, r in subset]
        drained = [(k, p) for k, p in zip(kv, post, strict=True) if p.finished == p.total]
        print(f"admission_pricing={pricing}:")
        print(f"  kvgate drained {sum(k.passed for k in kv)}/{len(kv)} cases with zero violations")
        print(
            f"  seed pre-fix drained {sum(p.finished == p.total for p in pre)}/{len(pre)}, "
            f"post-fix {len(drained)}/{len(post)}"
        )
        if drained:
            kp = sum(k.preemptions for k, _ in drained)
            pp = sum(p.preemptions for _, p in drained)
            worse_p = sum(k.preemptions > p.preemptions for k, p in drained)
            step_ratios = [k.steps / p.steps for k, p in drained]
            print(
                f"  on the {len(drained)} cases post-fix drained: preemptions {kp} vs {pp} "
                f"(ratio {kp / max(pp, 1):.2f}); cases with more preemptions than post-fix: "
                f"{worse_p}; steps ratio max {max(step_ratios):.2f}, "
                f"mean {sum(step_ratios) / len(step_ratios):.2f}"
            )
        if args.causes:
            print(f"  kvgate preemptions by cause ({pricing}):")
            tally = causes.get(pricing, Counter())
            for cause, count in sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"    {count:>4}  {cause}")
            print("  kvgate time to first token in steps, by priority (mean, p90):")
            for priority, values in sorted(first_token.get(pricing, {}).items()):
                ordered = sorted(values)
                p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
                print(
                    f"    priority {priority:>2}: {sum(values) / len(values):6.1f} {p90:>4}"
                    f"  ({len(values)} requests)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
