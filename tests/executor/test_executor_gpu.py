"""The executor on a CUDA device (skipped without one): Triton kernels under real plans, sizing
by memory fraction, CUDA-event kernel timing, pinned host snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.quantized import PackedSegment, QuantizedWeight
from kvgate.executor.reference import reference_logits
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType
from tests.executor.driver import Driver, DriverConfig
from tests.executor.hf_checkpoints import PROMPTS, kvgate_greedy
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


WEIGHT_ONLY = ["awq", "gptq-4bit-act-order", "gptq-8bit", "fp8-per-row", "fp8-per-tensor"]


def _set_config_dtype(model_dir: Path, dtype: str) -> None:
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"dtype": dtype}))


def _packed_on_cuda(loaded: LoadedModel) -> bool:
    o_proj = loaded.model.weights.layers[0].o_proj
    return (
        isinstance(o_proj, QuantizedWeight)
        and isinstance(o_proj.segments[0], PackedSegment)
        and o_proj.segments[0].packed.is_cuda
    )


# float32 activations, IEEE dots in the kernels and in cuBLAS: summation order only.
FLOAT32_REL_BOUND = 1e-5


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_kept_as_stored_matches_the_dequantized_model(
    tmp_path: Path, name: str
) -> None:
    """AWQ, GPTQ and FP8 projections stay as stored on the GPU and the compiled
    dequantize-in-the-GEMM kernels run them: logits within float32 rounding of the same
    checkpoint dequantized when read (cuBLAS on the float weights), and the same greedy ids
    from the paged executor."""
    from tests.executor.test_weight_only_checkpoints import _write

    case = _write(name, tmp_path / name)
    _set_config_dtype(case.model_dir, "float32")  # auto on CUDA is the config's dtype
    packed = load_model(case.model_dir, device="cuda")
    assert _packed_on_cuda(packed)
    assert packed.model.weights.norm.dtype == torch.float32
    dequantized = load_model(case.model_dir, device="cuda", dtype=DType.FLOAT32)
    assert not _packed_on_cuda(dequantized)
    for prompt, greedy in zip(case.prompts, case.greedy_ids, strict=True):
        tokens = prompt + greedy
        error = _relative_error(
            reference_logits(packed.model, tokens, len(prompt)),
            reference_logits(dequantized.model, tokens, len(prompt)),
        )
        assert error < FLOAT32_REL_BOUND, error
    answers = kvgate_greedy(packed)
    assert answers == kvgate_greedy(dequantized)
    agree = sum(
        a == b
        for ours, hf in zip(answers, case.greedy_ids, strict=True)
        for a, b in zip(ours, hf, strict=True)
    )
    print(f"{name}: {agree} of {sum(map(len, answers))} greedy ids equal transformers' on the CPU")


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


# bf16 activations against the float32 model: the rounding of bf16 (8 bits of mantissa) through
# three layers and the logits; a misplaced nibble or group measures order 1.
HALF_REL_BOUND = 3e-2


def test_weight_only_in_bfloat16_is_close_to_the_float32_model(tmp_path: Path) -> None:
    """A checkpoint whose config says bfloat16 runs the kernels with bf16 activations, close to
    the same weights dequantized and run in float32."""
    from tests.executor.test_weight_only_checkpoints import _write

    case = _write("awq", tmp_path / "awq")
    _set_config_dtype(case.model_dir, "bfloat16")
    packed = load_model(case.model_dir, device="cuda")
    assert _packed_on_cuda(packed)
    assert packed.model.weights.norm.dtype == torch.bfloat16
    float32 = load_model(case.model_dir, device="cuda", dtype=DType.FLOAT32)
    assert not _packed_on_cuda(float32)
    tokens = PROMPTS[1]
    error = _relative_error(
        reference_logits(packed.model, tokens, 8), reference_logits(float32.model, tokens, 8)
    )
    assert error < HALF_REL_BOUND, error


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_run_on_cuda_close_to_the_float32_model(tmp_path: Path, kind: str) -> None:
    """A GGUF file's blocks stay as stored on the GPU (``auto``: bf16 activations) and the
    compiled kernels run them: logits close to the file dequantized to float32 on the GPU, and
    the paged executor runs its requests to the end with them."""
    import gguf

    from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
    from tests.real_model.gguf_writer import write_llama_gguf

    spec = TinyModelSpec(hidden_size=64, intermediate_size=96, vocab_size=273, seed=3)
    model_dir = make_tiny_model(tmp_path / "hf", spec)
    path = write_llama_gguf(tmp_path / "tiny.gguf", model_dir, kind=gguf.GGMLQuantizationType[kind])
    quantized = load_model(path, device="cuda")
    assert isinstance(quantized.model.weights.layers[0].o_proj, QuantizedWeight)
    dequantized = load_model(path, device="cuda", dtype=DType.FLOAT32)
    tokens = [5, 60, 7, 200, 11, 90, 3, 41, 17]
    error = _relative_error(
        reference_logits(quantized.model, tokens, 5), reference_logits(dequantized.model, tokens, 5)
    )
    assert error < HALF_REL_BOUND, error
    answers = kvgate_greedy(quantized, [tokens[:4], tokens], max_tokens=6)
    assert [len(a) for a in answers] == [6, 6]
