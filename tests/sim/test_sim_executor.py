"""The simulated executor: dense-reference agreement, and plan validation that changes nothing."""

from __future__ import annotations

import pytest

from kvgate.protocol.step import (
    BlockAppend,
    DecodeRows,
    ErrorCode,
    NewRequest,
    PrefillRow,
    SamplingParams,
    StepPlan,
    SwapIn,
)
from kvgate.scheduler.config import Mode, PreemptionMode, SchedulerConfig
from kvgate.sim.executor import SimExecutor
from kvgate.sim.runner import run_once
from kvgate.sim.workload import (
    CacheSection,
    ExitMode,
    ModelSection,
    Workload,
    WorkloadRequest,
)
from tests.sim.dense_reference import generate


def _workload(
    exit_mode: ExitMode, preemption: PreemptionMode, mode: Mode, wavefront: bool
) -> Workload:
    requests = [
        WorkloadRequest(
            id=f"q{i}",
            arrival_step=i,
            prompt_len=3 + 4 * i,
            max_tokens=9,
            seed=i,
            priority=i % 2 * 5,
            exit_depths=[3, 1, 2, 3, 2, 1, 1, 3, 2] if exit_mode is ExitMode.TRACE else None,
        )
        for i in range(4)
    ]
    return Workload(
        model=ModelSection(loops=3, min_loops=1, exit=exit_mode, vocab_size=50, seed=3),
        cache=CacheSection(num_blocks=36, block_size=2, host_snapshot_blocks=18),
        scheduler=SchedulerConfig(
            max_num_seqs=3,
            max_num_batched_tokens=9,
            prefill_chunk_size=3,
            mode=mode,
            wavefront_prefill=wavefront,
            preemption=preemption,
            min_residency_steps=1,
            max_admission_bypasses=2,
        ),
        requests=requests,
        max_steps=600,
    )


@pytest.mark.parametrize("exit_mode", list(ExitMode))
@pytest.mark.parametrize(
    "preemption", [PreemptionMode.SNAPSHOT, PreemptionMode.RECOMPUTE, PreemptionMode.AUTO]
)
@pytest.mark.parametrize("mode,wavefront", [(Mode.MIXED, True), (Mode.REFILL, False)])
def test_paged_run_under_pressure_equals_dense_reference(
    exit_mode: ExitMode, preemption: PreemptionMode, mode: Mode, wavefront: bool
) -> None:
    workload = _workload(exit_mode, preemption, mode, wavefront)
    run = run_once(workload)
    assert run.preemptions > 0, "the cache must be small enough to force preemption"
    assert not run.invariant_violations
    for request in workload.requests:
        outcome = run.outcomes[request.id]
        assert outcome.status == "finished"
        assert (list(outcome.output_token_ids), list(outcome.exit_depths)) == generate(
            workload, request
        )


def _executor() -> SimExecutor:
    return SimExecutor(
        ModelSection(loops=2, vocab_size=32), num_blocks=8, block_size=2, host_snapshot_blocks=2
    )


def _start(executor: SimExecutor) -> None:
    plan = StepPlan(
        step_id=1,
        new_requests=[
            NewRequest(
                request_id="a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)
            )
        ],
        block_appends=[BlockAppend(request_id="a", new_block_ids=[[0, 1], [2, 3]])],
        prefill_rows=[
            PrefillRow(
                request_id="a",
                token_start=0,
                token_end=3,
                depth_first=1,
                depth_last=2,
                completes_fill=True,
            )
        ],
    )
    result = executor.execute(plan)
    assert result.error is None and len(result.sampled_tokens()) == 1


@pytest.mark.parametrize(
    ("plan", "code", "needle"),
    [
        (StepPlan(step_id=2, free=["ghost"]), ErrorCode.UNKNOWN_REQUEST, "ghost"),
        (
            StepPlan(
                step_id=2, block_appends=[BlockAppend(request_id="a", new_block_ids=[[9], [4]])]
            ),
            ErrorCode.BLOCK_OUT_OF_RANGE,
            ">= num_blocks",
        ),
        (
            StepPlan(step_id=2, swap_in=[SwapIn(request_id="a", block_ids=[[4, 5], [6, 7]])]),
            ErrorCode.MISSING_SNAPSHOT,
            "no snapshot",
        ),
        (StepPlan(step_id=2, swap_out=["a"]), ErrorCode.HOST_BUDGET_EXCEEDED, "host blocks"),
        (
            StepPlan(step_id=2, decode=DecodeRows(request_ids=["a"], positions=[7], depths=[1])),
            ErrorCode.BAD_PLAN,
            "position 7",
        ),
        (
            StepPlan(step_id=2, new_requests=[NewRequest(request_id="a", prompt_token_ids=[1])]),
            ErrorCode.BAD_PLAN,
            "already registered",
        ),
        (
            StepPlan(
                step_id=2,
                prefill_rows=[
                    PrefillRow(
                        request_id="a", token_start=3, token_end=6, depth_first=1, depth_last=1
                    )
                ],
            ),
            ErrorCode.BAD_PLAN,
            "complete",
        ),
    ],
)
def test_bad_plans_are_rejected_with_a_reason_and_change_nothing(
    plan: StepPlan, code: ErrorCode, needle: str
) -> None:
    executor = _executor()
    _start(executor)
    before = (executor.counters, [list(b) for b in executor._kv])
    result = executor.execute(plan)
    assert result.error is not None
    assert result.error.code is code
    assert needle in result.error.message
    assert (executor.counters, [list(b) for b in executor._kv]) == before
    # ...and the request still decodes normally afterwards.
    ok = executor.execute(
        StepPlan(step_id=3, decode=DecodeRows(request_ids=["a"], positions=[3], depths=[1]))
    )
    assert ok.error is None and ok.decode.request_ids == ["a"]


class _Corrupting:
    """``SimExecutor`` that, after each step, changes one K/V slot of a full page some request
    attends to, checks that request's context against a fold from scratch, and puts it back."""

    def __init__(self, inner: SimExecutor) -> None:
        self.inner = inner
        self.info = inner.info
        self.checked = 0

    @property
    def counters(self) -> object:
        return self.inner.counters

    def execute(self, plan: StepPlan) -> object:
        result = self.inner.execute(plan)
        sim = self.inner
        for request in list(sim._requests.values()):
            position = request.cursor_position
            if position < 2 * sim.block_size or not request.tables[0]:
                continue
            sim._context(request, 1, position)  # the fold is remembered
            block = request.tables[0][0]
            before = sim._kv[block][0]
            assert before is not None
            sim._kv[block][0] = before ^ 1  # a corruption, as a wrong write would leave it
            sim._drop_digest(block)
            memo = request.context_folds.pop(1)
            fresh = sim._context(request, 1, position)
            request.context_folds[1] = memo
            assert sim._context(request, 1, position) == fresh, "a stale fold was reused"
            sim._kv[block][0] = before
            sim._drop_digest(block)
            self.checked += 1
            break
        return result


def test_a_remembered_context_fold_never_outlives_a_change_of_its_pages() -> None:
    workload = _workload(ExitMode.FIXED, PreemptionMode.AUTO, Mode.MIXED, True)
    executor = _Corrupting(
        SimExecutor(
            workload.model,
            num_blocks=workload.cache.num_blocks,
            block_size=workload.cache.block_size,
            host_snapshot_blocks=workload.cache.host_snapshot_blocks,
        )
    )
    run = run_once(workload, executor=executor)  # type: ignore[arg-type]
    assert executor.checked > 10
    assert all(o.status == "finished" for o in run.outcomes.values())


def test_a_decode_row_past_its_pages_is_rejected() -> None:
    """A decode row of a request nothing else in the plan touches is checked against the pages
    it holds (the validator reads such a request without a shadow of it)."""
    executor = _executor()
    _start(executor)  # a: 3 prompt tokens, 2 pages of 2 slots per plane
    decode = DecodeRows(request_ids=["a"], positions=[None], depths=[None])
    for step_id in (2, 3):  # position 3 at depths 1 and 2: the last slot of page 2
        assert executor.execute(StepPlan(step_id=step_id, decode=decode)).error is None
    result = executor.execute(StepPlan(step_id=4, decode=decode))  # position 4 needs page 3
    assert result.error is not None and result.error.code is ErrorCode.BAD_PLAN
    assert "position 4 beyond its 2 pages" in result.error.message
