"""The executor on a CUDA device (skipped without one): Triton kernels under real plans, sizing
by memory fraction, CUDA-event kernel timing, pinned host snapshots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType
from tests.executor.driver import Driver, DriverConfig
from tests.executor.workloads import mixed_requests, reference_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama_dir", "looped_dir"])
def test_cuda_fp32_matches_the_reference(request: pytest.FixtureRequest, family: str) -> None:
    model_dir: Path = request.getfixturevalue(family)
    loaded = load_model(model_dir, device="cuda", dtype=DType.FLOAT32)
    requests = mixed_requests(loaded, count=6, seed=0)
    expected = reference_outputs(loaded, requests)
    executor = Executor(loaded, num_blocks=400, block_size=4, host_snapshot_blocks=200)
    config = DriverConfig(
        chunk_size=4, wavefront=True, async_plans=True,
        swap_after={"req-0-0": 3}, recompute_after={"req-0-1": 2},
    )  # fmt: skip
    driver = Driver(executor, requests, config)
    assert driver.run() == expected
    assert executor.counters == wire.ExecutorCounters()
    kernel_s = [r.timings.kernel_s for r in driver.results if r.decode.request_ids]
    assert all(k is not None and k > 0.0 for k in kernel_s)


def test_memory_fraction_sizing_and_pinned_snapshots(looped_dir: Path) -> None:
    executor = Executor(
        looped_dir, num_blocks=None, memory_fraction=0.05, device="cuda", dtype=DType.BFLOAT16,
        host_snapshot_blocks=64, block_size=16,
    )  # fmt: skip
    _, total = torch.cuda.mem_get_info()
    assert executor.info.num_blocks >= 1
    assert executor.info.num_blocks * executor.info.kv_bytes_per_block <= 0.05 * total
    assert executor.cache.keys.is_cuda and executor.cache.keys.dtype == torch.bfloat16
    request = wire.NewRequest(request_id="r", prompt_token_ids=list(range(1, 20)))
    fill = wire.StepPlan(
        step_id=1,
        new_requests=[request],
        block_appends=[wire.BlockAppend(request_id="r", new_block_ids=[[0, 1], [2, 3], [4, 5]])],
        prefill_rows=[
            wire.PrefillRow(
                request_id="r", token_start=0, token_end=19, depth_first=1, depth_last=3,
                completes_fill=True,
            )
        ],
    )  # fmt: skip
    assert executor.execute(fill).error is None
    assert executor.execute(wire.StepPlan(step_id=2, swap_out=["r"])).error is None
    snapshot = executor._snapshots["r"]
    assert snapshot.keys.is_pinned() and snapshot.values.is_pinned()
    swap_in = wire.SwapIn(request_id="r", block_ids=[[10, 11], [12, 13], [14, 15]])
    decode = wire.DecodeRows(request_ids=["r"], positions=[19], depths=[1])
    result = executor.execute(wire.StepPlan(step_id=3, swap_in=[swap_in], decode=decode))
    assert result.error is None and result.timings.kernel_s is not None
    assert 0.0 < result.timings.kernel_s < result.timings.execute_s


def test_the_sampler_draws_on_the_device_without_waiting_for_it() -> None:
    """Every row of a mixed batch is drawn on the GPU with no host synchronization (CUDA's sync
    debug mode raises on any) and gets the token the one-row rules give on the CPU."""
    from kvgate.executor.sampler import SampleRow, sample_each, sample_on_device
    from tests.executor.test_executor_sampling import MIXED_PARAMS

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=gen) * torch.linspace(0.1, 8.0, 64).unsqueeze(1)
    rows = [SampleRow(f"r{i}", 3 * i, MIXED_PARAMS[i % len(MIXED_PARAMS)]) for i in range(64)]
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_on_device(on_gpu, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.is_cuda
    assert tokens.tolist() == sample_each(logits, rows)
