"""Scheduler lifecycle: rejection on arrival, abort, deadlines, evacuation, stalls, misuse."""

from __future__ import annotations

import itertools

import pytest

from kvgate.protocol.enums import FinishReason
from kvgate.protocol.step import ErrorCode, StepError, StepResult
from kvgate.scheduler.config import (
    CacheConfig,
    ModelShape,
    SchedulerConfig,
)
from kvgate.scheduler.errors import (
    PlanRejected,
    RequestRejected,
    SchedulerStalled,
)
from kvgate.scheduler.events import FinishedEvent
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.scheduler import Scheduler
from kvgate.scheduler.state import SchedulerState
from kvgate.scheduler.strategy import KvgateStrategy
from tests.scheduler.harness import Rig, spec


def _scheduler(**config: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig.model_validate(config),
        CacheConfig(num_blocks=16, block_size=4),
        ModelShape(num_loops=2, max_model_len=40),
    )


@pytest.mark.parametrize(
    ("request_spec", "needle"),
    [
        (spec("big", 30, 8), "whole cache has 16"),
        (spec("long", 30, 20), "exceeds max_model_len (40)"),
        (spec("empty", 0, 2, prompt=()), "prompt is empty"),
        (spec("trace", 3, 3, trace=[1, 2, 2]), "exit_trace[0] must be the full depth 2"),
        (spec("short", 3, 3, trace=[2, 2]), "exit_trace has 2 depths for max_tokens 3"),
    ],
)
def test_impossible_requests_are_rejected_on_arrival_with_a_reason(
    request_spec: object, needle: str
) -> None:
    scheduler = _scheduler()
    with pytest.raises(RequestRejected) as info:
        scheduler.add_request(request_spec)  # type: ignore[arg-type]
    assert needle in info.value.reason
    assert not scheduler.has_work


def test_duplicate_in_flight_id_is_rejected() -> None:
    scheduler = _scheduler()
    scheduler.add_request(spec("a", 3, 2))
    with pytest.raises(RequestRejected, match="already in flight"):
        scheduler.add_request(spec("a", 3, 2))


def test_abort_frees_blocks_and_tells_the_executor() -> None:
    rig = Rig(num_blocks=12, block_size=2, loops=2)
    rig.add("a", prompt_len=5, max_tokens=6)
    rig.add("b", prompt_len=3, max_tokens=6)
    rig.step()
    assert rig.scheduler.abort("a")
    assert not rig.scheduler.abort("a")
    events = rig.scheduler.pop_events()
    assert [e.reason for e in events if isinstance(e, FinishedEvent)] == [FinishReason.ABORT]
    plan = rig.step()
    assert plan is not None and "a" in plan.free
    rig.drain()
    assert rig.executor.counters.num_requests == 0
    assert rig.scheduler.state.pool.num_used_blocks == 0


def test_deadline_expires_waiting_and_running_requests() -> None:
    rig = Rig(num_blocks=12, block_size=2, max_num_seqs=1)
    rig.scheduler.add_request(spec("slow", 3, 20, deadline_s=3.5))
    rig.scheduler.add_request(spec("queued", 3, 2, deadline_s=2.5))
    rig.drain()
    assert rig.finished["slow"].reason is FinishReason.DEADLINE
    assert rig.finished["queued"].reason is FinishReason.DEADLINE
    assert len(rig.finished["slow"].output_token_ids) < 20


def test_evacuated_requests_resume_elsewhere_by_recompute_with_the_same_outputs() -> None:
    def make() -> Rig:
        return Rig(
            num_blocks=40,
            block_size=2,
            loops=3,
            host_snapshot_blocks=12,
            preemption="snapshot",
            max_num_seqs=2,
        )

    reference = make()
    for rid, prompt in (("a", 7), ("b", 4), ("c", 9)):
        reference.add(rid, prompt_len=prompt, max_tokens=8, seed=3)
    reference.drain()

    lost = make()
    for rid, prompt in (("a", 7), ("b", 4), ("c", 9)):
        lost.add(rid, prompt_len=prompt, max_tokens=8, seed=3)
    for _ in range(9):
        lost.step()
    lifted = lost.scheduler.evacuate(executor_alive=False)
    assert lifted and not lost.scheduler.has_work
    survivor = make()
    for progress in lifted:
        survivor.scheduler.add_request(progress.spec, progress=progress)
    survivor.drain()
    merged = {**lost.finished, **survivor.finished}
    for rid, event in reference.finished.items():
        assert merged[rid].output_token_ids == event.output_token_ids
        assert merged[rid].exit_depths == event.exit_depths


class _NeverRuns(KvgateStrategy):
    """A deliberately broken strategy: it admits but never gives anyone a row."""

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        self.admit(state, builder)


def test_a_scheduler_that_makes_no_progress_raises_with_a_dump() -> None:
    rig = Rig(num_blocks=12, block_size=2, stall_steps=5, strategy=_NeverRuns())
    rig.add("a", prompt_len=3, max_tokens=3)
    with pytest.raises(SchedulerStalled) as info:
        for _ in range(20):
            rig.scheduler.schedule(0.0)
            if rig.scheduler.num_inflight:
                plan = rig.scheduler.state.inflight[min(rig.scheduler.state.inflight)]
                rig.scheduler.apply(rig.executor.execute(plan))
    assert "running (admission order)" in info.value.dump
    assert "a key=" in info.value.dump


def test_sync_scheduling_refuses_a_second_plan_in_flight() -> None:
    rig = Rig(num_blocks=12, block_size=2)
    rig.add("a", prompt_len=3, max_tokens=3)
    assert rig.scheduler.schedule(0.0) is not None
    with pytest.raises(RuntimeError, match="in flight"):
        rig.scheduler.schedule(1.0)


def test_an_executor_error_result_surfaces_as_plan_rejected() -> None:
    rig = Rig(num_blocks=12, block_size=2)
    rig.add("a", prompt_len=3, max_tokens=3)
    plan = rig.scheduler.schedule(0.0)
    assert plan is not None
    error = StepError(code=ErrorCode.BAD_PLAN, message="no such block")
    with pytest.raises(PlanRejected, match="no such block"):
        rig.scheduler.apply(StepResult(step_id=plan.step_id, error=error))


def test_prefix_cache_skips_shared_prompt_pages_and_keeps_outputs() -> None:
    prompt = tuple(range(10, 27))  # 17 tokens: 4 full cacheable pages of 4
    rig = Rig(num_blocks=64, block_size=4, loops=2)
    rig.scheduler.add_request(spec("first", 0, 4, prompt=prompt))
    rig.drain()
    rig.scheduler.add_request(spec("second", 0, 4, prompt=prompt))
    plan = rig.step()
    assert plan is not None
    first_row = plan.prefill_rows[0]
    assert first_row.token_start == 16  # four cached pages, the last token is recomputed
    rig.drain()
    assert rig.finished["second"].output_token_ids == rig.finished["first"].output_token_ids


def test_preemption_off_never_preempts_and_still_drains() -> None:
    rig = Rig(num_blocks=24, block_size=2, loops=2, preemption="off", max_num_seqs=4)
    for i in range(6):
        rig.add(f"r{i}", prompt_len=3 + i, max_tokens=5, priority=5 - i)
    rig.drain()
    assert all(e.stats.preemptions == 0 for e in rig.finished.values())
    assert len(rig.finished) == 6


def test_refill_mode_gives_each_step_one_stage_and_alternates_when_both_wait() -> None:
    rig = Rig(
        num_blocks=64,
        block_size=2,
        mode="refill",
        max_num_batched_tokens=4,
        prefill_chunk_size=2,
        max_prefill_steps_before_decode=1,
    )
    rig.add("decoder", prompt_len=2, max_tokens=12)
    rig.step()  # its whole prompt fits one chunk: it decodes from now on
    rig.add("filler", prompt_len=12, max_tokens=2)
    kinds = []
    for _ in range(8):
        plan = rig.step()
        assert plan is not None
        has_prefill, has_decode = bool(plan.prefill_rows), bool(plan.decode.request_ids)
        assert not (has_prefill and has_decode), "refill never mixes stages in one step"
        kinds.append("P" if has_prefill else "D")
    assert all(a != b for a, b in itertools.pairwise(kinds[:6])), kinds


def test_mixed_mode_puts_prefill_and_decode_rows_in_one_step() -> None:
    rig = Rig(
        num_blocks=64, block_size=2, mode="mixed", max_num_batched_tokens=4, prefill_chunk_size=2
    )
    rig.add("decoder", prompt_len=2, max_tokens=12)
    rig.step()
    rig.add("filler", prompt_len=12, max_tokens=2)
    plan = rig.step()
    assert plan is not None and plan.prefill_rows and plan.decode.request_ids
