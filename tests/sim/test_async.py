"""Async scheduling (one step in flight, executor-side placeholders) equals synchronous runs."""

from __future__ import annotations

import pytest

from kvgate.scheduler.config import Mode
from kvgate.sim.livelock_cases import LIVELOCK_SEEDS, livelock_case
from kvgate.sim.runner import arrivals, build_scheduler, run_once, sim_executor


@pytest.mark.parametrize("seed", LIVELOCK_SEEDS)
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("wavefront", [False, True])
def test_async_outputs_equal_sync_outputs_with_preemption(
    seed: int, mode: Mode, wavefront: bool
) -> None:
    sync = run_once(livelock_case(seed, mode=mode, wavefront=wavefront, async_scheduling=False))
    overlapped = run_once(
        livelock_case(seed, mode=mode, wavefront=wavefront, async_scheduling=True)
    )
    assert overlapped.preemptions > 0
    assert not overlapped.invariant_violations
    outputs = {rid: (o.output_token_ids, o.exit_depths) for rid, o in sync.outcomes.items()}
    assert {
        rid: (o.output_token_ids, o.exit_depths) for rid, o in overlapped.outcomes.items()
    } == outputs


def test_async_plans_use_placeholders_for_undecided_exits() -> None:
    """With a hash exit policy the scheduler cannot know whether an in-flight pass exits: the
    next row must leave position and depth to the executor."""
    workload = livelock_case(8, mode=Mode.MIXED, wavefront=True, async_scheduling=True)
    scheduler = build_scheduler(workload)
    executor = sim_executor(workload)
    for arrival in arrivals(workload):
        scheduler.add_request(arrival.spec)
    placeholders = 0
    pending = []
    for clock in range(400):
        plan = scheduler.schedule(float(clock)) if scheduler.num_inflight < 2 else None
        if plan is not None:
            placeholders += sum(p is None for p in plan.decode.positions)
            pending.append(executor.execute(plan))
        if pending and (len(pending) == 2 or plan is None):
            scheduler.apply(pending.pop(0))
        if not scheduler.has_work and not pending:
            break
    assert not scheduler.has_work
    assert placeholders > 0
