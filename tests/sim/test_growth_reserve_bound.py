"""The growth reserve's cheap upper bound really bounds it, on every step of the livelock suite.

Admission skips the walk over running requests when even the bound fits (``GrowthReserve`` in
admission.py), so a bound below the true reserve would admit requests the reserve should have
held back.
"""

from __future__ import annotations

from kvgate.scheduler.admission import GrowthReserve
from kvgate.scheduler.config import AdmissionPricing
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.state import SchedulerState
from kvgate.scheduler.strategy import KvgateStrategy
from kvgate.sim.livelock_cases import livelock_suite
from kvgate.sim.simulate import simulate


class _BoundRecording(KvgateStrategy):
    """Before each step, (upper bound, exact reserve) for every waiting request."""

    def __init__(self) -> None:
        self.pairs: list[tuple[int | None, int]] = []

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        for request in state.waiting.ordered():
            exact = GrowthReserve(state).blocks_for(request)
            self.pairs.append((GrowthReserve(state).upper_bound(request), exact))
        super().plan_step(state, builder)


def test_the_upper_bound_holds_on_every_step_under_fill_pricing() -> None:
    reserved = 0
    for name, workload in livelock_suite((AdmissionPricing.FILL,)):
        strategy = _BoundRecording()
        report = simulate(workload, strategy=strategy, check=False, audit=False)
        assert report.finished == report.total, name
        below = [(b, e) for b, e in strategy.pairs if b is None or b < e]
        assert below == [], (name, below[:5])
        reserved += sum(1 for _, exact in strategy.pairs if exact > 0)
    assert reserved > 100  # the check saw real, non-zero reserves


def test_no_cheap_bound_is_claimed_under_first_chunk_pricing() -> None:
    _, workload = livelock_suite((AdmissionPricing.FIRST_CHUNK,))[0]
    strategy = _BoundRecording()
    simulate(workload, strategy=strategy, check=False, audit=False)
    assert strategy.pairs
    assert all(bound is None for bound, _ in strategy.pairs)
