"""The livelock suite: ten requests of mixed priority under cache pressure, every configuration.

Each case must drain within its step cap with the invariants checked after every step (and the
bypass bound audited independently of the scheduler's counters), and produce exactly the outputs
of the unconstrained, preemption-free reference run.
"""

from __future__ import annotations

import pytest

from benchmarks.baselines import SeedPreFix
from kvgate.admission_service.scheduler.config import AdmissionPricing
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import Workload
from kvgate.sim.workloads import livelock_suite

CASES = livelock_suite()


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


def test_the_suite_catches_the_seed_livelock() -> None:
    """The seed's pre-fix rule (restores skip the bypass accounting, blocked restores skip the
    limit) must fail at least one case — by not draining, or by preempting 10x more."""
    failures = []
    for name, workload in livelock_suite((AdmissionPricing.FIRST_CHUNK,)):
        ours = simulate(workload, check=False, audit=False)
        seed = simulate(workload, strategy=SeedPreFix(), check=False, audit=False)
        if seed.finished < seed.total or seed.preemptions >= 10 * ours.preemptions:
            failures.append((name, seed.finished, seed.preemptions, ours.preemptions))
    assert failures, "the suite no longer distinguishes the livelocking rule"


def test_the_seed_rule_breaks_the_audited_bypass_bound() -> None:
    name, workload = CASES[0]
    report = simulate(workload, strategy=SeedPreFix())
    assert report.max_bypasses > workload.scheduler.max_admission_bypasses, name
    assert any(v.startswith("audit:") for v in report.violations)
