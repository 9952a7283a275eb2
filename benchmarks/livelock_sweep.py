"""The livelock sweep: 40 arrival seeds × refill/mixed × two cache sizes, every rule, in totals.

The shape of the sweep that vllm-rlt's own scheduler was measured on: ten requests from
``livelock_case`` (chunked prefill, synchronous, priorities 0/5/10, four loops, block size 2,
chunk 2, ``max_num_seqs`` 4, bypass limit 2, scan limit 16, watermark 0, 500-step cap) on a cache
of 52 or 64 blocks, prefix caching off. Every rule runs every case with the same simulated
executor and its invariants checked after every step; the unconstrained reference is computed
once per case.

kvgate's goal on it: every case drains; its preemptions are at most 0.35× the post-fix rule's
in total and at most the post-fix rule's on every case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.baselines import SeedPostFix
from kvgate.scheduler.config import Mode
from kvgate.scheduler.strategy import Strategy
from kvgate.sim.livelock_cases import livelock_case
from kvgate.sim.report import SimReport
from kvgate.sim.runner import RunResult
from kvgate.sim.simulate import ReferenceRun, simulate, simulated_reference
from kvgate.sim.workload import Workload

SEEDS = tuple(range(40))
MODES = (Mode.REFILL, Mode.MIXED)
CACHE_BLOCKS = (52, 64)
GOAL_RATIO = 0.35


def sweep_cases() -> list[tuple[str, Workload]]:
    cases = []
    for seed in SEEDS:
        for mode in MODES:
            for num_blocks in CACHE_BLOCKS:
                workload = livelock_case(seed, mode=mode, wavefront=False, async_scheduling=False)
                cache = workload.cache.model_copy(
                    update={"num_blocks": num_blocks, "enable_prefix_caching": False}
                )
                name = f"{mode.value}-{num_blocks}blocks-seed{seed}"
                cases.append((name, workload.model_copy(update={"cache": cache})))
    return cases


@dataclass(slots=True)
class RuleTotals:
    name: str
    cases: int = 0
    drained: int = 0
    passed: int = 0  # drained with none of its own invariants broken
    preemptions: int = 0
    over_bypass_limit: int = 0  # cases where its own counter passed max_admission_bypasses
    recomputed_tokens: int = 0
    steps: int = 0
    kvgate_invariant_violations: int = 0
    per_case: dict[str, SimReport] = field(default_factory=dict)

    def add(self, case: str, report: SimReport, limit: int) -> None:
        self.cases += 1
        self.drained += report.finished == report.total and not report.stalled
        self.passed += report.passed
        self.preemptions += report.preemptions
        self.over_bypass_limit += report.max_counted_bypasses > limit
        self.recomputed_tokens += report.recomputed_tokens
        self.steps += report.steps
        self.kvgate_invariant_violations += report.kvgate_invariant_violations
        self.per_case[case] = report


def _once(run: RunResult) -> ReferenceRun:
    """The reference run of a case, computed once and shared by every rule."""
    return lambda _workload: run


def run_sweep(strategies: list[Callable[[], Strategy]]) -> list[RuleTotals]:
    totals: dict[str, RuleTotals] = {}
    for name, workload in sweep_cases():
        reference = _once(simulated_reference(workload))
        limit = workload.scheduler.max_admission_bypasses
        for make in strategies:
            strategy = make()
            report = simulate(workload, strategy=strategy, reference=reference)
            totals.setdefault(strategy.name, RuleTotals(strategy.name)).add(name, report, limit)
    return list(totals.values())


@dataclass(frozen=True, slots=True)
class Goal:
    drains_all: bool
    ratio: float
    cases_above: list[str]

    @property
    def met(self) -> bool:
        return self.drains_all and self.ratio <= GOAL_RATIO and not self.cases_above


def kvgate_goal(kvgate: RuleTotals, post_fix: RuleTotals) -> Goal:
    above = [
        case
        for case, report in kvgate.per_case.items()
        if report.preemptions > post_fix.per_case[case].preemptions
    ]
    return Goal(
        drains_all=kvgate.drained == kvgate.cases,
        ratio=kvgate.preemptions / max(post_fix.preemptions, 1),
        cases_above=above,
    )


def _ratio(value: int, base: int) -> str:
    return f"{value / base:.2f}" if base else "n/a"


def print_sweep(totals: list[RuleTotals]) -> Goal:
    post = next(t for t in totals if t.name == SeedPostFix.name)
    cases = post.cases
    print(
        f"{cases} cases: {len(SEEDS)} arrival seeds x {'/'.join(m.value for m in MODES)} x "
        f"{'/'.join(map(str, CACHE_BLOCKS))} blocks (livelock_case, chunked, sync, "
        "prefix caching off)"
    )
    header = (
        f"{'rule':<38} {'drained':>8} {'passed':>7} {'preempt':>8} {'/post':>6} "
        f"{'more':>5} {'over-limit':>10} {'recomputed':>10} {'steps/post':>10} {'kvgate-inv':>10}"
    )
    print(header)
    for t in totals:
        more = sum(
            report.preemptions > post.per_case[case].preemptions
            for case, report in t.per_case.items()
        )
        print(
            f"{t.name:<38} {t.drained:>4}/{t.cases:<3} {t.passed:>7} {t.preemptions:>8} "
            f"{_ratio(t.preemptions, post.preemptions):>6} {more:>5} {t.over_bypass_limit:>10} "
            f"{t.recomputed_tokens:>10} {_ratio(t.steps, post.steps):>10} "
            f"{t.kvgate_invariant_violations:>10}"
        )
    print(
        "columns: drained = all 10 finished within the cap; passed = drained with none of its "
        "own invariants broken; /post and steps/post = against seed-post-fix in total; more = "
        "cases with more preemptions than seed-post-fix; over-limit = cases where its own "
        "bypass counter passed max_admission_bypasses; kvgate-inv = breaks of kvgate invariants "
        "the rule does not promise (reported, not judged)"
    )
    kvgate = next(t for t in totals if t.name == "kvgate")
    goal = kvgate_goal(kvgate, post)
    print(
        f"kvgate goal (drains all; preemptions <= {GOAL_RATIO}x seed-post-fix in total; never "
        f"more on a case): {'MET' if goal.met else 'NOT MET'} — drained {kvgate.drained}/"
        f"{kvgate.cases}, {kvgate.preemptions} vs {post.preemptions} ({goal.ratio:.2f}x), "
        f"{len(goal.cases_above)} cases above"
        + (f": {', '.join(goal.cases_above[:8])}" if goal.cases_above else "")
    )
    return goal


def sweep_json(totals: list[RuleTotals], goal: Goal) -> dict[str, Any]:
    return {
        "rules": {
            t.name: {
                "cases": t.cases,
                "drained": t.drained,
                "passed": t.passed,
                "preemptions": t.preemptions,
                "over_bypass_limit": t.over_bypass_limit,
                "recomputed_tokens": t.recomputed_tokens,
                "steps": t.steps,
                "kvgate_invariant_violations": t.kvgate_invariant_violations,
                "per_case_preemptions": {c: r.preemptions for c, r in t.per_case.items()},
            }
            for t in totals
        },
        "goal": {
            "met": goal.met,
            "drains_all": goal.drains_all,
            "ratio": goal.ratio,
            "cases_above": goal.cases_above,
        },
    }
