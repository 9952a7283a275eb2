"""Regression: a residency window that could never end, and the restore that caused it.

Found by the reliability scenarios (crash and cache pressure) and reduced to two requests on the
pure scheduler, answered by the simulated executor::

    step 1   r0 and r1 (same priority) start; 6 blocks of 4 tokens, no host memory
    step 7   r0, the running-order leader, needs a page: r1 is preempted (recompute)
    step 8   r1 was restored at once, into the blocks r0 was about to need again
    step 10  r0 needs its next page; the only victim, r1, was restored 2 steps ago and is
             protected from an equal-class requester for 4 steps. Nothing could run, and an
             empty step did not advance the step counter, so the window never ended:
             SchedulerStalled.

Two fixes, each guarded here: empty steps count (the window runs out), and a request evicted for
another's growth restarts only with room left for its evictor's next page (so it is not
restored into the conflict at all).

Both scenarios turn the growth reserve off (``growth_reserve_steps=0``): with it, r1 would not
start beside r0 in the first place, and neither fix would be exercised.
"""

from __future__ import annotations

import pytest

from kvgate.protocol.step import LoopParams, SamplingParams
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.events import FinishedEvent
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.sim.backend import SimExecutorConfig

CACHE = CacheConfig(num_blocks=6, block_size=4, host_snapshot_blocks=0)


def _run_to_the_end(min_residency_steps: int) -> int:
    """Drive two same-priority requests to completion; returns how many preemptions it took."""
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        stall_steps=64,
        min_residency_steps=min_residency_steps,
        growth_reserve_steps=0,
    )
    scheduler = Scheduler(config, CACHE, ModelShape(num_loops=1))
    executor = SimExecutorConfig(num_blocks=CACHE.num_blocks, block_size=CACHE.block_size).build()
    for rid, prompt, max_tokens in (("r0", 7, 15), ("r1", 9, 7)):
        scheduler.add_request(
            RequestSpec(
                request_id=rid,
                prompt_token_ids=tuple(range(1, prompt + 1)),
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                loops=LoopParams(),
                priority=0,
            )
        )
    finished: set[str] = set()
    preemptions = 0
    while scheduler.has_work:
        plan = scheduler.schedule(0.0)
        if plan is not None:
            preemptions += len(scheduler.last_report.preemptions)
            events = scheduler.apply(executor.execute(plan))
            scheduler.check_invariants()
            finished |= {e.request_id for e in events if isinstance(e, FinishedEvent)}
    assert finished == {"r0", "r1"}
    return preemptions


@pytest.mark.parametrize("min_residency_steps", [0, 2, 4, 8])
def test_the_leader_never_stalls_and_the_victim_waits_for_room(min_residency_steps: int) -> None:
    # One preemption: r1 comes back only once r0 no longer needs its blocks.
    assert _run_to_the_end(min_residency_steps) == 1


def test_a_residency_window_runs_out_even_while_nothing_can_be_planned() -> None:
    """Every row waits on a victim inside its residency window: the empty steps must still count,
    or the window (and the scheduler) would wait forever."""
    from tests.scheduler.harness import Rig

    rig = Rig(
        num_blocks=4,
        block_size=1,
        min_residency_steps=4,
        growth_reserve_steps=0,
        preemption="recompute",
        watermark_ratio=0.0,
        max_num_batched_tokens=8,
        prefill_chunk_size=8,
    )
    rig.add("r0", prompt_len=2, max_tokens=3)
    rig.add("r1", prompt_len=2, max_tokens=3)
    rig.step()  # both fill (two blocks each: the cache is full) and sample their first token
    state = rig.scheduler.state
    state.requests["r1"].restored_step = state.step  # as if r1 had just been restored
    empty = 0
    while rig.step() is None:
        empty += 1
        assert empty <= 4, "the residency window never ran out"
    assert [p.victim_id for p in rig.scheduler.last_report.preemptions] == ["r1"]
    rig.drain()
    assert set(rig.finished) == {"r0", "r1"}
