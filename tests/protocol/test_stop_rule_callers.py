"""The token stop rule (``kvgate.protocol.stopping``) as each of its callers applies it.

Four parts decide when a request stops and must agree on the token: the scheduler (it finishes
the request and reports the reason), the batch planner (it plans no pass after the last token),
the executor's request state (it skips rows of a finished request) and the simulated executor.
Each is driven here through its own entry point with the same token stream — the simulator's
tokens for one request, so that the simulator runs unmodified and the EOS id of each case is
picked among them — and must stop where the table says. ``min_tokens`` and
``stop_token_ids`` are cases of the same table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from kvgate.protocol.enums import FinishReason
from kvgate.protocol.step import (
    BlockAppend,
    DecodeOutcomes,
    DecodeRows,
    NewRequest,
    PrefillRow,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
)
from kvgate.protocol.stopping import StopRule
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.events import FinishedEvent
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.sim.executor import SimExecutor
from kvgate.sim.workload import ModelSection

RID = "r"
PROMPT = (5, 11, 17)
VOCAB = 97
STREAM_LEN = 8  # longer than any case runs, plus the one extra pass a broken planner would ask


@dataclass(frozen=True)
class Case:
    name: str
    max_tokens: int
    eos_output: int | None  # the model's EOS id is the token of this output (1-based); None: no EOS
    ignore_eos: bool
    reason: FinishReason
    num_outputs: int
    min_tokens: int = 0
    stop_output: int | None = None  # the token of this output (1-based) is a stop token id

    @property
    def sampling(self) -> SamplingParams:
        stops = [] if self.stop_output is None else [stream()[self.stop_output - 1]]
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=stops,
        )

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_output is None else stream()[self.eos_output - 1]


STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
CASES = [
    Case("eos-on-the-max-tokens-th-output", 3, 3, False, STOP, 3),
    Case("eos-before-max-tokens", 5, 2, False, STOP, 2),
    Case("eos-as-the-first-output", 4, 1, False, STOP, 1),
    Case("eos-ignored", 4, 2, True, LENGTH, 4),
    Case("eos-ignored-on-the-last-output", 3, 3, True, LENGTH, 3),
    Case("max-tokens-1", 1, None, False, LENGTH, 1),
    Case("max-tokens-1-and-eos", 1, 1, False, STOP, 1),
    Case("no-eos", 4, None, False, LENGTH, 4),
    Case("stop-token-id", 5, None, False, STOP, 2, stop_output=2),
    Case("stop-token-id-and-an-ignored-eos", 5, 1, True, STOP, 3, stop_output=3),
    Case("min-tokens-holds-the-eos-back", 5, 2, False, LENGTH, 5, min_tokens=3),
    Case("min-tokens-reached-at-the-eos", 5, 3, False, STOP, 3, min_tokens=3),
    Case("min-tokens-holds-a-stop-token-back", 3, None, False, LENGTH, 3, 2, stop_output=1),
]
by_name = pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])


# --- the simulated executor ------------------------------------------------------------------
def _sim_outputs(sampling: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The tokens the simulator emits for the request, asked for one more pass each step until
    it skips the row (the executor's answer for a request it considers finished), at most
    ``STREAM_LEN`` tokens."""
    sim = SimExecutor(
        ModelSection(vocab_size=VOCAB, eos_token_id=eos_token_id),
        num_blocks=1,
        block_size=16,
        host_snapshot_blocks=0,
    )
    new = NewRequest(request_id=RID, prompt_token_ids=list(PROMPT), sampling=sampling)
    fill = PrefillRow(
        request_id=RID,
        token_start=0,
        token_end=len(PROMPT),
        depth_first=1,
        depth_last=1,
        completes_fill=True,
    )
    result = sim.execute(
        StepPlan(
            step_id=1,
            new_requests=[new],
            block_appends=[BlockAppend(request_id=RID, new_block_ids=[[0]])],
            prefill_rows=[fill],
        )
    )
    outputs = [token.token_id for token in result.sampled_tokens()]
    for step_id in range(2, STREAM_LEN + 1):
        # Position and depth left to the executor, as an async plan does.
        decode = DecodeRows(request_ids=[RID], positions=[None], depths=[None])
        result = sim.execute(StepPlan(step_id=step_id, decode=decode))
        assert result.error is None, result.error
        if result.skipped_request_ids == [RID]:
            break
        outputs.extend(token.token_id for token in result.sampled_tokens())
    return outputs


@functools.cache
def stream() -> tuple[int, ...]:
    """The simulator's tokens for the request, far from any stop (so that they do not depend
    on the stop rule under test)."""
    tokens = _sim_outputs(SamplingParams(max_tokens=4 * STREAM_LEN, ignore_eos=True), None)
    assert len(tokens) == STREAM_LEN, tokens
    # Each case's EOS id must first occur at the output it names.
    longest = max(case.max_tokens for case in CASES)
    assert len(set(tokens[:longest])) == longest, tokens
    return tuple(tokens)


# --- the scheduler and its batch planner -----------------------------------------------------
class _ScriptedExecutor:
    """Answers every completed fill and every decode pass with the next token of the stream.

    It applies no stop rule of its own: whatever the scheduler plans, it runs."""

    def __init__(self) -> None:
        self.num_emitted = 0

    def _next(self, position: int) -> SampledToken:
        token = stream()[self.num_emitted]
        self.num_emitted += 1
        return SampledToken(request_id=RID, position=position, token_id=token, exit_depth=1)

    def execute(self, plan: StepPlan) -> StepResult:
        tokens = [self._next(row.token_end) for row in plan.prefill_rows if row.completes_fill]
        positions: list[int] = []
        for _ in plan.decode.request_ids:
            positions.append(len(PROMPT) + self.num_emitted - 1)  # the cursor: the newest token
            tokens.append(self._next(positions[-1] + 1))
        rows = len(positions)
        decode = DecodeOutcomes(
            request_ids=list(plan.decode.request_ids),
            positions=positions,
            depths=[1] * rows,
            exited=[True] * rows,
        )
        return StepResult(step_id=plan.step_id, tokens=tokens, decode=decode)


@dataclass(frozen=True)
class _SchedulerRun:
    finished: FinishedEvent
    decode_rows: int  # decode rows planned for the request
    decode_rows_alone: int  # of these, planned with no other plan in flight


def _run_scheduler(case: Case, *, async_scheduling: bool) -> _SchedulerRun:
    scheduler = Scheduler(
        SchedulerConfig(async_scheduling=async_scheduling),
        CacheConfig(num_blocks=4, block_size=16),
        ModelShape(eos_token_id=case.eos_token_id),
    )
    scheduler.add_request(
        RequestSpec(request_id=RID, prompt_token_ids=PROMPT, sampling=case.sampling)
    )
    executor = _ScriptedExecutor()
    plans_in_flight = 2 if async_scheduling else 1
    pending: list[StepPlan] = []
    finished: list[FinishedEvent] = []
    decode_rows = decode_rows_alone = 0
    for clock in range(4 * STREAM_LEN):
        plan = scheduler.schedule(float(clock)) if len(pending) < plans_in_flight else None
        if plan is not None:
            rows = plan.decode.request_ids.count(RID)
            decode_rows += rows
            decode_rows_alone += 0 if pending else rows
            pending.append(plan)
        if pending and (len(pending) == plans_in_flight or plan is None):
            events = scheduler.apply(executor.execute(pending.pop(0)))
            finished.extend(e for e in events if isinstance(e, FinishedEvent))
        if not scheduler.has_work and not pending:
            break
    assert len(finished) == 1, finished
    return _SchedulerRun(finished[0], decode_rows, decode_rows_alone)


# --- the tests -------------------------------------------------------------------------------
@by_name
def test_the_rule(case: Case) -> None:
    stop = StopRule.of(case.sampling, case.eos_token_id)
    reasons = [stop.finish_reason(n, token) for n, token in enumerate(stream(), start=1)]
    num_outputs = next(n for n, reason in enumerate(reasons, start=1) if reason is not None)
    assert (reasons[num_outputs - 1], num_outputs) == (case.reason, case.num_outputs)


@by_name
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_scheduler_and_its_planner(case: Case, async_scheduling: bool) -> None:
    run = _run_scheduler(case, async_scheduling=async_scheduling)
    assert run.finished.reason is case.reason
    assert run.finished.output_token_ids == stream()[: case.num_outputs]
    # Every output after the first comes from a decode pass. With async scheduling the planner
    # plans each pass while the previous token is in flight — unless that token is the last by
    # length; one that turns out to be the EOS leaves its successor's pass wasted.
    wasted = 1 if async_scheduling and case.num_outputs < case.max_tokens else 0
    assert run.decode_rows == case.num_outputs - 1 + wasted
    if async_scheduling:
        assert run.decode_rows_alone == 0  # never held back a pass that was still needed


@by_name
def test_the_executor_request_state(case: Case) -> None:
    requests = pytest.importorskip("kvgate.executor.requests")  # the executor needs torch
    eos = case.eos_token_id
    new = NewRequest(request_id=RID, prompt_token_ids=list(PROMPT), sampling=case.sampling)
    state = requests.RequestState.register(new, num_loops=1, span_context=None)
    # As the runner does: the fill's last row samples the first output, then the fill ends ...
    state.outputs.append(stream()[0])
    state.exit_depths.append(1)
    state.finish_fill(eos)
    for token in stream()[1:]:
        if state.finished:
            break
        # ... and each decode pass that exits appends its token and asks the rule again.
        state.outputs.append(token)
        state.exit_depths.append(1)
        state.finished = requests.is_finished(state.outputs, state.sampling, eos)
    assert state.finished
    assert tuple(state.outputs) == stream()[: case.num_outputs]


@by_name
def test_the_simulated_executor(case: Case) -> None:
    outputs = _sim_outputs(case.sampling, case.eos_token_id)
    assert tuple(outputs) == stream()[: case.num_outputs]
