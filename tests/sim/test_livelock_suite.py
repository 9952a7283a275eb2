"""The livelock suite: ten requests of mixed priority under cache pressure, every configuration.

Each case must drain within its step cap with the invariants checked after every step (and the
bypass bound audited independently of the scheduler's counters), and produce exactly the outputs
of the unconstrained, preemption-free reference run.

The same cases run again with tenants, weights and deadlines (``tenant_livelock_suite``): fair
sharing and deadline order change who goes first, never whether everything drains, and the
fair-order invariant holds after every step.

One more case runs without the growth reserve: there the residency window refuses an eviction
that would otherwise happen, so the case depends on it (no case of the suite proper does; the
growth reserve leaves the window nothing to act on).
"""

from __future__ import annotations

import pytest

from benchmarks.baselines import SeedPostFix, SeedPreFix
from kvgate.scheduler.config import AdmissionPricing, Mode
from kvgate.sim.livelock_cases import livelock_case, livelock_suite, tenant_livelock_suite
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import Workload


def _residency_case() -> tuple[str, Workload]:
    workload = livelock_case(
        15,
        mode=Mode.REFILL,
        wavefront=True,
        async_scheduling=False,
        pricing=AdmissionPricing.FIRST_CHUNK,
    )
    scheduler = workload.scheduler.model_copy(update={"growth_reserve_steps": 0})
    name = "first_chunk-refill-wavefront-sync-seed15-no-growth-reserve"
    return name, workload.model_copy(update={"scheduler": scheduler})


RESIDENCY_CASE = _residency_case()
CASES = [*livelock_suite(), RESIDENCY_CASE, *tenant_livelock_suite()]


@pytest.mark.parametrize(("name", "workload"), CASES, ids=[name for name, _ in CASES])
def test_case_drains_with_invariants_and_reference_outputs(name: str, workload: Workload) -> None:
    report = simulate(workload)
    assert report.finished == report.total == 10, report.to_text()
    assert report.preemptions > 0, "the suite exists to exercise preemption"
    assert report.invariant_violations == 0, report.violations
    assert report.max_bypasses <= workload.scheduler.max_admission_bypasses
    assert report.outputs_match_reference, report.mismatched_requests
    assert report.leaked_blocks == report.leaked_snapshots == report.leaked_executor_requests == 0
    assert not report.stalled
    assert report.steps < workload.max_steps


def test_the_residency_case_depends_on_the_residency_window() -> None:
    """Without the window the same case evicts a request restored within it, and preempts
    more: the window, not luck, keeps this case's count (with it broken, the case above fails
    on the residency invariant)."""
    name, workload = RESIDENCY_CASE
    with_window = simulate(workload)
    scheduler = workload.scheduler.model_copy(update={"min_residency_steps": 0})
    without = simulate(workload.model_copy(update={"scheduler": scheduler}))
    assert with_window.passed and without.passed, name
    assert without.preemptions > with_window.preemptions


def test_the_suite_tells_the_pre_fix_rule_from_the_fix() -> None:
    """vllm-rlt's pre-fix rule (a restore bypasses nobody, a blocked restore skips the limit)
    drains the suite but lets its own bypass counter pass the limit; the fixed rule keeps it,
    and both are judged by their own rules, not kvgate's."""
    over_pre, over_post = [], []
    for name, workload in livelock_suite((AdmissionPricing.FILL,)):
        limit = workload.scheduler.max_admission_bypasses
        pre = simulate(workload, strategy=SeedPreFix(), audit=False)
        post = simulate(workload, strategy=SeedPostFix(), audit=False)
        assert pre.finished == pre.total and post.finished == post.total, name
        assert post.passed, (name, post.violations)
        if pre.max_counted_bypasses > limit:
            over_pre.append(name)
            assert not pre.passed
        if post.max_counted_bypasses > limit:
            over_post.append(name)
    assert over_pre, "the suite no longer shows the pre-fix rule's fairness bug"
    assert not over_post


def test_a_baseline_is_not_failed_by_kvgate_invariants_it_does_not_promise() -> None:
    name, workload = CASES[0]
    report = simulate(workload, strategy=SeedPostFix())
    assert report.kvgate_invariant_violations > 0, name  # e.g. preemptions that did not help
    assert report.invariant_violations == 0 and report.passed
