"""Swap-out copies every block (every plane and page) and the request's whole state to the host;
swap-in restores them bit-exactly into different blocks, even between two loop passes of a token."""

from __future__ import annotations

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from tests.executor.workloads import reference_outputs

R = 3

REQUEST = wire.NewRequest(
    request_id="a",
    prompt_token_ids=[9, 8, 7, 6, 5, 4, 3],
    sampling=wire.SamplingParams(temperature=0.9, seed=2, max_tokens=7),
    loops=wire.LoopParams(exit_threshold=0.7),
)


def _blocks(ex: Executor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(ids)
    return ex.cache.keys[index].clone(), ex.cache.values[index].clone()


def test_swap_out_and_in_between_passes_is_bit_exact(looped: LoadedModel) -> None:
    ex = Executor(looped, num_blocks=40, block_size=4, host_snapshot_blocks=9)
    old = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # 3 pages per plane
    step = iter(range(1, 1000))
    tokens: list[wire.SampledToken] = []

    def run(**fields: object) -> wire.StepResult:
        result = ex.execute(wire.StepPlan(step_id=next(step), **fields))  # type: ignore[arg-type]
        assert result.error is None, result.error
        tokens.extend(result.sampled_tokens())
        return result

    def decode() -> wire.StepResult:
        return run(decode=wire.DecodeRows(request_ids=["a"], positions=[None], depths=[None]))

    run(
        new_requests=[REQUEST],
        block_appends=[wire.BlockAppend(request_id="a", new_block_ids=old)],
        prefill_rows=[
            wire.PrefillRow(
                request_id="a",
                token_start=0,
                token_end=7,
                depth_first=1,
                depth_last=R,
                completes_fill=True,
            )
        ],
    )
    # Decode until a token stops between passes (its hidden state and gate mass are in flight).
    while decode().decode.exited != [False]:
        assert len(tokens) < REQUEST.sampling.max_tokens
    state = ex._requests["a"]
    assert state.cursor is not None and state.cursor.passes_done >= 1
    cursor_hidden = state.cursor.hidden.clone() if state.cursor.hidden is not None else None
    remaining = state.cursor.remaining
    keys, values = _blocks(ex, [b for plane in old for b in plane])

    run(swap_out=["a"])
    assert ex.counters == wire.ExecutorCounters(num_requests=1, num_snapshots=1, host_blocks_used=9)
    assert ex.blocks_used == 0
    # Another request reuses the freed blocks meanwhile, overwriting them.
    ex.cache.keys[:9] = -1.0
    ex.cache.values[:9] = -1.0

    new = [[30, 12, 21], [13, 25, 14], [39, 16, 17]]
    run(swap_in=[wire.SwapIn(request_id="a", block_ids=new)])
    restored_keys, restored_values = _blocks(ex, [b for plane in new for b in plane])
    assert torch.equal(restored_keys, keys) and torch.equal(restored_values, values)
    state = ex._requests["a"]
    assert state.block_tables == new
    assert state.cursor is not None and state.cursor.remaining == remaining
    assert cursor_hidden is not None and state.cursor.hidden is not None
    assert torch.equal(state.cursor.hidden, cursor_hidden)
    assert state.cursor.hidden.device == ex.model.device
    assert ex.counters == wire.ExecutorCounters(num_requests=1)

    spare = iter([18, 19, 20, 22, 23, 24, 26, 27, 28, 29, 31, 32])  # not in old or new
    while len(tokens) < REQUEST.sampling.max_tokens:
        state = ex._requests["a"]
        assert state.cursor is not None
        appends = []
        if state.cursor.position // 4 + 1 > len(state.block_tables[0]):
            pages = [[next(spare)] for _ in range(R)]
            appends = [wire.BlockAppend(request_id="a", new_block_ids=pages)]
        run(
            block_appends=appends,
            decode=wire.DecodeRows(request_ids=["a"], positions=[None], depths=[None]),
        )
    expected = reference_outputs(looped, [(REQUEST, 1)])["a"]
    assert ([t.token_id for t in tokens], [t.exit_depth for t in tokens]) == expected
    run(free=["a"])
    assert ex.counters == wire.ExecutorCounters() and ex.blocks_used == 0


def test_free_of_a_swapped_out_request_drops_its_snapshot(looped: LoadedModel) -> None:
    ex = Executor(looped, num_blocks=12, block_size=4, host_snapshot_blocks=3)
    plans = [
        wire.StepPlan(
            step_id=1,
            new_requests=[REQUEST],
            block_appends=[wire.BlockAppend(request_id="a", new_block_ids=[[0], [1], [2]])],
            prefill_rows=[
                wire.PrefillRow(
                    request_id="a", token_start=0, token_end=4, depth_first=1, depth_last=1
                )
            ],
        ),
        wire.StepPlan(step_id=2, swap_out=["a"]),
        wire.StepPlan(step_id=3, free=["a"]),
    ]
    for plan in plans:
        assert ex.execute(plan).error is None
    assert ex.counters == wire.ExecutorCounters()


def test_reset_forgets_everything(looped: LoadedModel) -> None:
    ex = Executor(looped, num_blocks=12, block_size=4, host_snapshot_blocks=3)
    plan = wire.StepPlan(
        step_id=1,
        new_requests=[REQUEST, REQUEST.model_copy(update={"request_id": "b"})],
        block_appends=[wire.BlockAppend(request_id="a", new_block_ids=[[0], [1], [2]])],
        swap_out=[],
    )
    assert ex.execute(plan).error is None
    assert ex.execute(wire.StepPlan(step_id=2, swap_out=["a"])).error is None
    assert ex.counters == wire.ExecutorCounters(num_requests=2, num_snapshots=1, host_blocks_used=3)
    ex.reset()
    assert ex.counters == wire.ExecutorCounters() and ex.blocks_used == 0
    # The same ids can be registered again after a reset.
    assert ex.execute(plan.model_copy(update={"step_id": 3})).error is None


def test_calibration_reports_restore_cost_figures(looped: LoadedModel) -> None:
    ex = Executor(looped, num_blocks=40, block_size=4, host_snapshot_blocks=9)
    assert ex.info.host_bandwidth_bytes_per_s is None and ex.info.prefill_token_pass_s is None
    info = ex.calibrate()
    assert info.host_bandwidth_bytes_per_s is not None and info.host_bandwidth_bytes_per_s > 0
    assert info.prefill_token_pass_s is not None and 0 < info.prefill_token_pass_s < 1.0
    assert ex.info == info
    ex.execute(wire.StepPlan(step_id=1, new_requests=[REQUEST]))
    with pytest.raises(RuntimeError, match="idle"):
        ex.calibrate()


def test_swap_out_and_in_within_one_plan_relocates_the_blocks(looped: LoadedModel) -> None:
    ex = Executor(looped, num_blocks=12, block_size=4, host_snapshot_blocks=3)
    fill = wire.StepPlan(
        step_id=1,
        new_requests=[REQUEST],
        block_appends=[wire.BlockAppend(request_id="a", new_block_ids=[[0, 1], [2, 3], [4, 5]])],
        prefill_rows=[
            wire.PrefillRow(request_id="a", token_start=0, token_end=4, depth_first=1, depth_last=3)
        ],
    )
    assert ex.execute(fill).error is None
    keys, _ = _blocks(ex, [0, 1, 2, 3, 4, 5])
    # The snapshot needs its 6 host blocks even though it lives only inside this step.
    moved = wire.StepPlan(
        step_id=2,
        swap_out=["a"],
        swap_in=[wire.SwapIn(request_id="a", block_ids=[[6, 7], [8, 9], [10, 11]])],
    )
    result = ex.execute(moved)
    assert result.error is not None and result.error.code is wire.ErrorCode.HOST_BUDGET_EXCEEDED
    ex = Executor(looped, num_blocks=12, block_size=4, host_snapshot_blocks=6)
    assert ex.execute(fill).error is None
    assert ex.execute(moved).error is None
    relocated, _ = _blocks(ex, [6, 7, 8, 9, 10, 11])
    assert torch.equal(relocated, keys)
    assert ex.counters == wire.ExecutorCounters(num_requests=1) and ex.blocks_used == 6
