"""kvgate's compiled CPU kernels (``kvgate/kernels/cpu/ops.cpp``) against the torch path.

Each kernel is compared with the torch expression it replaces: bit for bit where the arithmetic
is the same operations in the same order (residual sums, RoPE, KV writes), else within stated
tolerances (sums of squares and softmax sums in another order; exp by a polynomial). Decode
attention is also checked against the float64 reference on NaN-poisoned caches. The kernels
are built once per machine into the kvgate cache (the first run of this module pays the cold
compile: docs/testing.md); without a compiler the module skips with the reason, and the
fallback test below still runs.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgate import kernels
from kvgate.executor.config import RopeScaling
from kvgate.executor.layer_ops import CompiledLayerOps, TorchLayerOps, prepare_cpu_kernels
from kvgate.executor.rope import RotaryTable
from kvgate.kernels import cpu, torch_attention
from tests.kernels.paged_cases import MIXED_ROWS, WINDOW_ROWS, PagedBatch, Row, build_batch
from tests.kernels.test_kernels_attention import (
    SOFTCAP,
    SOFTCAP_SCALE,
    assert_matches_reference,
    window_batch,
)

REPO = Path(__file__).resolve().parents[2]
TORCH_OPS, COMPILED_OPS = TorchLayerOps(), CompiledLayerOps()
DECODE_ROWS = [Row(1, 23), Row(1, 20), Row(0, 0), Row(4, 9), Row(1, 17), Row(2, 0), Row(1, 70)]


@pytest.fixture(scope="module")
def compiled_kernels() -> None:
    result = prepare_cpu_kernels()
    if not result.compiled:
        pytest.skip(result.log_line())


def _rows(n: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=generator) * scale


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("n", [1, 7, 300])
def test_rms_norm_and_the_fused_residual_add(n: int) -> None:
    x, residual, weight = _rows(n, 576, 1), _rows(n, 576, 2, 30.0), _rows(1, 576, 3)[0]
    expected = TORCH_OPS.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(
        COMPILED_OPS.rms_norm(x, weight, 1e-5), expected, rtol=2e-6, atol=1e-6
    )

    total, normed = COMPILED_OPS.add_rms_norm(x, residual, weight, 1e-5)
    want_total, want_normed = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total)  # one IEEE add per element either way
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=1e-6)


@pytest.mark.usefixtures("compiled_kernels")
def test_rms_norm_reads_strided_rows() -> None:
    wide = _rows(5, 1200, 4)
    x, weight = wide[:, 100:676], _rows(1, 576, 5)[0]
    torch.testing.assert_close(
        COMPILED_OPS.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6),
        rtol=2e-6, atol=1e-6,
    )  # fmt: skip


@pytest.mark.usefixtures("compiled_kernels")
def test_silu_and_mul_over_the_whole_range() -> None:
    gate_up = _rows(64, 2 * 1536, 6, 8.0)
    gate_up[0, :9] = torch.tensor([-200.0, -88.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 88.0, 200.0])
    out = COMPILED_OPS.silu_and_mul(gate_up)
    expected = TORCH_OPS.silu_and_mul(gate_up)
    # exp within 1.4 ulp, then a divide and a multiply: a few ulp of the result.
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
    assert out.shape == (64, 1536)


@pytest.mark.usefixtures("compiled_kernels")
def test_rotary_is_the_textbook_rotation_bit_for_bit() -> None:
    table = RotaryTable(64, 10000.0, RopeScaling(), torch.device("cpu"))
    positions = torch.tensor([0, 5, 17, 300, 4095, 2])
    rotation = table.at(positions, 4095)
    qkv = torch.randn(6, 9 + 2 * 3, 64)
    want_q, want_k, want_v = TORCH_OPS.rotate_qk(qkv, rotation, 9, 3)
    want = (want_q.clone(), want_k.clone(), want_v.clone())
    q, k, v = COMPILED_OPS.rotate_qk(qkv.clone(), rotation, 9, 3)
    for got, expected in zip((q, k, v), want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.usefixtures("compiled_kernels")
def test_write_kv_matches_index_put_bit_for_bit() -> None:
    num_blocks, num_layers, block_size, kv_heads, head_dim = 6, 3, 4, 2, 16
    caches = [torch.full((num_blocks, num_layers, block_size, kv_heads, head_dim), float("nan"))
              for _ in range(4)]  # fmt: skip
    key, value = torch.randn(5, kv_heads, head_dim), torch.randn(5, kv_heads, head_dim)
    slots = torch.tensor([3, 17, -1, 8, 23])  # one padding token
    for compiled, (key_cache, value_cache) in ((False, caches[:2]), (True, caches[2:])):
        plan = kernels.plan_write_kv(
            slots, num_blocks=num_blocks, block_size=block_size, compiled=compiled
        )
        kernels.write_kv(key, value, key_cache[:, 1], value_cache[:, 1], slots, plan=plan)
    torch.testing.assert_close(caches[2], caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0, equal_nan=True)
    assert not caches[2][:, 1].isnan().all()


# Decode rows and prefill chunks: without context (longer than 16 positions, the vectorized
# kernel's chunk), with context across blocks, and a single-token prompt.
PREFILL_ROWS = [Row(40, 40), Row(1, 23), Row(37, 100), Row(0, 0), Row(3, 3), Row(1, 1)]


def _plan(
    batch: PagedBatch, sliding_window: int | None = None, **flags: bool
) -> kernels.AttentionPlan | None:
    return kernels.plan_attention(
        batch.block_tables, batch.query_start_loc, batch.seq_lens,
        num_tokens=batch.query.shape[0], num_blocks=batch.key_cache.shape[0],
        block_size=batch.key_cache.shape[1], sliding_window=sliding_window, **flags,
    )  # fmt: skip


def _compiled_and_torch(
    batch: PagedBatch, sliding_window: int | None = None, logit_softcap: float | None = None
) -> dict[bool, torch.Tensor]:
    results = {}
    for compiled in (False, True):
        plan = _plan(batch, sliding_window, compiled=compiled)
        results[compiled] = kernels.paged_attention(
            *batch.args(), batch.softmax_scale, plan=plan,
            sliding_window=sliding_window, logit_softcap=logit_softcap,
        )  # fmt: skip
    return results


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (6, 1, 128), (4, 2, 40)],
    ids=["mha", "gqa3", "mqa6-d128", "gqa2-d40"],
)
@pytest.mark.parametrize("rows", [DECODE_ROWS, PREFILL_ROWS], ids=["decode", "prefill"])
def test_attention_in_place(
    num_q_heads: int, num_kv_heads: int, head_dim: int, rows: list[Row]
) -> None:
    batch = build_batch(
        rows, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=8,
    )  # fmt: skip
    results = _compiled_and_torch(batch)
    assert_matches_reference(batch, results[True])
    # Against the torch path: float32 sums in another order, exp by a polynomial.
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=2e-6)


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_attention_with_mixed_rows(block_size: int) -> None:
    batch = build_batch(
        MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size
    )
    results = _compiled_and_torch(batch)
    assert_matches_reference(batch, results[True])
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=2e-6)


def _per_token_plan(
    batch: PagedBatch, sliding_window: int | None = None
) -> kernels.AttentionPlan | None:
    return _plan(batch, sliding_window, compiled=True, per_token=True)


# Rows for the compiled kernel under a window: WINDOW_ROWS (decode and short chunks) and a
# chunk of 40 queries over 100 positions (several 16-token tiles, each with its own window).
WINDOW_PREFILL_ROWS = [*WINDOW_ROWS, Row(40, 100)]


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (6, 1, 128), (4, 2, 40)],
    ids=["mha", "gqa3", "mqa6-d128", "gqa2-d40"],
)
@pytest.mark.parametrize("sliding_window", [1, 7, 8, 16, 200])
def test_attention_in_place_with_sliding_window(
    num_q_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int
) -> None:
    """Windows of one position, inside a block, one and two blocks (edges on boundaries) and
    longer than every context; the blocks before each row's window are poisoned and unlisted."""
    batch = window_batch(
        sliding_window, rows=WINDOW_PREFILL_ROWS, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
    )  # fmt: skip
    results = _compiled_and_torch(batch, sliding_window)
    assert_matches_reference(batch, results[True], sliding_window=sliding_window)
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=2e-6)


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["causal", "window-8"])
def test_attention_in_place_with_logit_softcap(head_dim: int, sliding_window: int | None) -> None:
    rows = WINDOW_PREFILL_ROWS
    batch = (
        build_batch(rows, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=8)
        if sliding_window is None
        else window_batch(sliding_window, rows=rows, head_dim=head_dim)
    )
    batch = dataclasses.replace(batch, softmax_scale=SOFTCAP_SCALE)
    options = {"sliding_window": sliding_window, "logit_softcap": SOFTCAP}
    results = _compiled_and_torch(batch, **options)
    # The compiled tanh comes from exp_approx: within 1e-7 absolutely, times the cap (4) per
    # score; scores of ~8 also cost 8 * 2**-24 each.
    assert_matches_reference(batch, results[True], (2e-5, 2e-5), **options)
    torch.testing.assert_close(results[True], results[False], rtol=2e-5, atol=5e-6)


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize(
    ("sliding_window", "logit_softcap"),
    [(None, None), (9, None), (9, SOFTCAP)],
    ids=["causal", "window-9", "window-9-softcap"],
)
def test_per_token_attention_does_not_depend_on_the_chunk(
    head_dim: int, sliding_window: int | None, logit_softcap: float | None
) -> None:
    """With ``per_token`` (the batch-invariant mode) each token of a prefill chunk gets the bits
    it gets as a one-query row over the same positions: the output does not depend on where
    the scheduler cut the prompt, nor on the other rows of the step (with a window too)."""
    batch = build_batch(
        [Row(37, 100), Row(1, 23), Row(16, 16)], num_q_heads=6, num_kv_heads=2,
        head_dim=head_dim, block_size=8,
    )  # fmt: skip
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    chunked = kernels.paged_attention(
        *batch.args(), batch.softmax_scale, plan=_per_token_plan(batch, sliding_window), **options
    )
    assert_matches_reference(batch, chunked, (2e-5, 2e-5), **options)
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for row in range(len(lens)):
        q_len = starts[row + 1] - starts[row]
        for t in range(q_len):
            token = starts[row] + t
            alone = dataclasses.replace(
                batch,
                query=batch.query[token : token + 1].clone(),
                block_tables=batch.block_tables[row : row + 1].clone(),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([lens[row] - q_len + t + 1], dtype=torch.int32),
            )
            out = kernels.paged_attention(
                *alone.args(), alone.softmax_scale,
                plan=_per_token_plan(alone, sliding_window), **options,
            )  # fmt: skip
            assert torch.equal(out[0], chunked[token]), f"row {row} token {t}"


def _half_precision_batch() -> PagedBatch:
    return build_batch(
        MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=torch.float16,
    )  # fmt: skip


@pytest.mark.usefixtures("compiled_kernels")
def test_per_token_attention_refuses_caches_it_cannot_read() -> None:
    batch = _half_precision_batch()
    with pytest.raises(ValueError, match="per-token attention needs float32"):
        kernels.paged_attention(*batch.args(), batch.softmax_scale, plan=_per_token_plan(batch))
    with pytest.raises(ValueError, match="compiled kernel only"):
        _plan(batch, per_token=True)


def _refuse_torch_groups(*args: object, **kwargs: object) -> None:
    raise AssertionError("the torch decode groups or prefill chunks were built")


@pytest.mark.usefixtures("compiled_kernels")
def test_a_compiled_plan_builds_no_torch_groups_for_float32_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = build_batch(MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    monkeypatch.setattr(torch_attention.DecodeSlots, "build", _refuse_torch_groups)
    monkeypatch.setattr(torch_attention, "_QueryChunk", _refuse_torch_groups)
    plan = _plan(batch, compiled=True)
    for _ in range(2):  # every layer of a step
        out = kernels.paged_attention(*batch.args(), batch.softmax_scale, plan=plan)
        assert_matches_reference(batch, out)


@pytest.mark.usefixtures("compiled_kernels")
def test_a_compiled_plan_still_serves_half_precision_caches() -> None:
    # The compiled kernel reads float32 only: the torch groups are built on first use.
    batch = _half_precision_batch()
    plan = _plan(batch, compiled=True)
    assert isinstance(plan, kernels.AttentionPlan)
    for _ in range(2):
        out = kernels.paged_attention(*batch.args(), batch.softmax_scale, plan=plan)
        assert_matches_reference(batch, out)
    assert len(plan.decode_groups) >= 1 and len(plan.chunk_rows) >= 1


@pytest.mark.usefixtures("compiled_kernels")
def test_bad_input_gets_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="x must be float32"):
        COMPILED_OPS.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight has 3 elements"):
        COMPILED_OPS.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-5)
    with pytest.raises(RuntimeError, match="width must be even"):
        COMPILED_OPS.silu_and_mul(torch.ones(2, 5))
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.kvgate_cpu.write_kv(
            torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, cache.clone(), torch.tensor([8])
        )
    assert cache.count_nonzero() == 0  # nothing written


@pytest.mark.usefixtures("compiled_kernels")
def test_the_model_runs_the_compiled_ops_on_cpu_float32() -> None:
    from kvgate.executor.layer_ops import select_layer_ops

    assert select_layer_ops(torch.device("cpu"), torch.float32).compiled
    assert not select_layer_ops(torch.device("cpu"), torch.bfloat16).compiled


def _load_in_subprocess(tmp_path: Path, env: dict[str, str]) -> str:
    code = (
        "from pathlib import Path; from kvgate.kernels import cpu; "
        f"print(cpu.load(Path({str(tmp_path)!r})).log_line())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return done.stdout.strip()


def test_without_a_compiler_the_torch_path_is_taken_and_said(tmp_path: Path) -> None:
    line = _load_in_subprocess(tmp_path, {"CXX": "kvgate-no-such-compiler"})
    assert line == (
        "CPU kernels: pure torch fallback (no C++ compiler ('kvgate-no-such-compiler' not on PATH))"
    )
    assert not any(tmp_path.iterdir())  # nothing half-built left behind
    line = _load_in_subprocess(tmp_path, {cpu.DISABLE_ENV: "torch"})
    assert line == f"CPU kernels: pure torch fallback ({cpu.DISABLE_ENV}=torch)"


def test_an_unknown_setting_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.DISABLE_ENV, "fast")
    with pytest.raises(ValueError, match="KVGATE_CPU_KERNELS='fast': expected one of auto, torch"):
        cpu.load(tmp_path)
