"""The livelock suite under kvgate and other admission rules, side by side; or the sweep.

    python benchmarks/bench_livelock.py [--json] [--causes] [--growth-reserve-steps K] [--variants]
    python benchmarks/bench_livelock.py --sweep [--json]

For every suite case: finished requests, executor steps, preemptions, recomputed tokens and the
largest count of the rule's own bypass counter, for kvgate, vllm-rlt's rules before and after the
seed PR and a vLLM-style rule (benchmarks/baselines.py); ``--variants`` adds the named variants.
Ratios are against the post-fix rule measured in the same run; cases where it did not drain are
reported as such and left out of its ratios. ``--causes`` adds kvgate's preemptions tallied by
cause (benchmarks/preemption_causes.py); ``--growth-reserve-steps`` runs kvgate with another
growth reserve (0 turns it off). ``--sweep`` runs benchmarks/livelock_sweep.py instead: 160
cases, every rule, totals and kvgate's goal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baselines import VARIANTS, SeedPostFix, SeedPreFix, VllmStyle
from benchmarks.livelock_sweep import kvgate_goal, print_sweep, run_sweep, sweep_json
from benchmarks.preemption_causes import CauseRecorder
from kvgate.scheduler.strategy import KvgateStrategy, Strategy
from kvgate.sim.livelock_cases import livelock_suite
from kvgate.sim.report import SimReport
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import Workload

STRATEGIES: tuple[type[Strategy], ...] = (KvgateStrategy, SeedPreFix, SeedPostFix, VllmStyle)

STEP_MODEL_NOTE = """\
note: the seed rules are vllm-rlt's admission, preemption and restore rules run on kvgate's step
model. A vllm-rlt step is one stage batch (a decode token passes prelude, k recurrent batches and
coda, and its refill policy admits only when no boundary or due decode batch comes first); a
kvgate step holds rows of every stage and admits every step. vllm-rlt has no mixed mode, and its
wavefront prefill refuses preemption. Steps compare within this table, not with vllm-rlt's.
The baselines are judged by their own rules (conservation, feasibility, their own bypass
counter); kvgate's other invariants are counted apart and do not fail them."""


def _cell(report: SimReport) -> str:
    stall = " STALL" if report.stalled else ""
    return (
        f"{report.finished:>2}/{report.total} {report.steps:>4} {report.preemptions:>4} "
        f"{report.recomputed_tokens:>4} {report.max_counted_bypasses:>3}{stall}"
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
    parser.add_argument("--variants", action="store_true", help="add the baselines' variants")
    parser.add_argument(
        "--sweep", action="store_true", help="40 seeds x refill/mixed x 52/64 blocks, totals"
    )
    args = parser.parse_args()
    if args.growth_reserve_steps is not None and args.growth_reserve_steps < 0:
        parser.error("--growth-reserve-steps must be >= 0")
    if args.sweep:
        if args.causes or args.growth_reserve_steps is not None or args.variants:
            parser.error("--sweep runs every rule as configured; it takes only --json")
        return _sweep(as_json=args.json)
    strategies = STRATEGIES + (VARIANTS if args.variants else ())
    limit = 0
    rows = []
    causes: dict[str, Counter[str]] = {}
    first_token: dict[str, dict[int, list[int]]] = {}  # pricing -> priority -> steps
    for name, workload in livelock_suite():
        limit = workload.scheduler.max_admission_bypasses
        reports = {}
        for strategy_type in strategies:
            ours = strategy_type is KvgateStrategy
            run_on = _with_reserve(workload, args.growth_reserve_steps) if ours else workload
            strategy: Strategy = CauseRecorder() if ours else strategy_type()
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
    print(STEP_MODEL_NOTE)
    print()
    header = "fin   steps  pre  rec byp"
    names = [s.name for s in strategies]
    print(f"{'case':<44}" + "".join(f" | {n[:26]:<26}" for n in names))
    print(f"{'':<44}" + "".join(f" | {header:<26}" for _ in names))
    print(
        "(finished/total, executor steps, preemptions, recomputed tokens, largest count of the "
        "rule's own bypass counter)"
    )
    for name, reports in rows:
        print(f"{name:<44}" + "".join(f" | {_cell(reports[n]):<26}" for n in names))
    print()
    for pricing in ("fill", "first_chunk"):
        subset = [(n, r) for n, r in rows if n.startswith(pricing + "-")]
        kv = [r["kvgate"] for _, r in subset]
        post = [r["seed-post-fix"] for _, r in subset]
        drained = [(k, p) for k, p in zip(kv, post, strict=True) if p.finished == p.total]
        print(f"admission_pricing={pricing}:")
        if pricing == "first_chunk":
            print(
                "  (the seed rules price the whole fill whatever the workload says, as vllm-rlt "
                "does; the -first-chunk variants price the first chunk)"
            )
        print(f"  kvgate drained {sum(k.passed for k in kv)}/{len(kv)} cases with zero violations")
        for rule in names[1:]:
            reports_of = [r[rule] for _, r in subset]
            print(
                f"  {rule}: drained {sum(r.finished == r.total for r in reports_of)}/"
                f"{len(reports_of)}, {sum(r.preemptions for r in reports_of)} preemptions, "
                f"bypass counter over the limit of {limit} on "
                f"{sum(r.max_counted_bypasses > limit for r in reports_of)}/{len(reports_of)} "
                f"cases, {sum(r.kvgate_invariant_violations for r in reports_of)} breaks of "
                "kvgate invariants it does not promise"
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


def _sweep(*, as_json: bool) -> int:
    totals = run_sweep([*STRATEGIES[:3], *VARIANTS, VllmStyle])
    if as_json:
        by_name = {t.name: t for t in totals}
        goal = kvgate_goal(by_name["kvgate"], by_name[SeedPostFix.name])
        print(json.dumps(sweep_json(totals, goal), indent=2))
        return 0
    print(STEP_MODEL_NOTE)
    print()
    print_sweep(totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
