"""paged_attention on CPU: the Triton kernel (interpreted) and the vectorized torch path, both
against the loop reference of ``tests/kernels/reference.py`` (float64).

Tolerances (absolute, relative) against the float64 reference, per input dtype:

* float32 — (2e-5, 1e-5). Inputs are exact in both; the only differences are float32
  accumulation order and exp2-based softmax rounding, a few ulps (2**-24) amplified by sums over
  at most a few dozen positions; 2e-5 leaves room without hiding an indexing error, which moves
  outputs by O(0.1).
* float16 — (5e-3, 5e-3). The reference sees the same fp16-rounded inputs, so the error comes
  from two roundings inside the kernel: the probabilities are cast to fp16 for the P·V tensor-core
  product (2**-11 relative each) and the output is stored as fp16 (half an ulp: 2**-11 relative,
  about 1e-3 at |out| ~ 2). Accumulation stays float32.
* bfloat16 — the Triton interpreter cannot do bf16 arithmetic (the launcher refuses it there), so
  only the torch path is checked here, with (2e-2, 1e-2) for storing the output in bf16;
  ``test_kernels_gpu.py`` covers the kernel on a GPU with (3e-2, 2e-2).

The caches are NaN-poisoned outside every row's context (see ``paged_cases``), so a read of a
wrong block or position fails loudly rather than within tolerance. Under a sliding window the
blocks before each row's window are poisoned too and their block-table entries point outside
the cache (``forget_before_window``): a backend that reads them, instead of starting at the
window, fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from kvgate import kernels
from kvgate.kernels import torch_attention, triton_attention
from tests.kernels.paged_cases import (
    MIXED_ROWS,
    WINDOW_ROWS,
    PagedBatch,
    Row,
    build_batch,
    forget_before_window,
)
from tests.kernels.reference import paged_attention_reference

TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (5e-3, 5e-3)}

AttentionFn = Callable[..., torch.Tensor]


@pytest.fixture(params=["triton-interpreted", "torch"])
def attention(request: pytest.FixtureRequest) -> AttentionFn:
    """The public ``paged_attention``, dispatched to one CPU backend."""
    request.getfixturevalue(
        "interpreted_triton" if request.param == "triton-interpreted" else "torch_backend"
    )
    return kernels.paged_attention


def assert_matches_reference(
    batch: PagedBatch,
    actual: torch.Tensor,
    tolerance: tuple[float, float] | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    expected = paged_attention_reference(
        *batch.args(),
        batch.softmax_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    atol, rtol = tolerance or TOLERANCES[batch.query.dtype]
    assert actual.dtype == batch.query.dtype
    assert not torch.isnan(actual).any(), "read outside a row's context (NaN-poisoned)"
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)
    # Every token of a row with context got a non-trivial answer; padding tokens got zeros.
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        rows_out = actual[starts[r] : starts[r + 1]]
        if seq_len == 0:
            assert torch.count_nonzero(rows_out) == 0
        elif rows_out.numel():
            assert rows_out.abs().amax() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"),
    [(2, 2), (4, 2), (8, 2), (8, 1)],
    ids=["mha", "gqa2", "gqa4", "gqa8"],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_reference(
    attention: AttentionFn,
    dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> None:
    """GQA ratios 1, 2, 4 and 8 over every row kind of ``MIXED_ROWS``."""
    batch = build_batch(
        MIXED_ROWS,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=80,  # not a power of two: padded to 128 with masks
        block_size=block_size,
        dtype=dtype,
        seed=num_q_heads * 100 + num_kv_heads * 10 + block_size,
    )
    out = attention(*batch.args(), batch.softmax_scale)
    assert_matches_reference(batch, out)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(6, 1, 64), (12, 4, 96), (4, 4, 256), (2, 1, 32)],
    ids=["mqa-6", "gqa-3-d96", "mha-d256", "gqa-2-d32"],
)
def test_head_shapes(
    attention: AttentionFn, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Group sizes that are not powers of two and head_dims from 32 to 256."""
    rows = [Row(1, 20), Row(4, 11), Row(3, 3)]
    batch = build_batch(
        rows,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=4,
        dtype=torch.float16,
    )
    assert_matches_reference(batch, attention(*batch.args(), batch.softmax_scale))


def test_large_logits_stay_finite(attention: AttentionFn) -> None:
    """Logits in the hundreds must not overflow the online softmax.

    The tolerance is wider than float32's usual one because rounding a score s costs
    |s| * 2**-24 absolute, and the softmax turns that into a relative weight error: at
    |s| ~ 250 about 1.5e-5 per score, a few 1e-5 on the output.
    """
    batch = build_batch(
        [Row(1, 40), Row(9, 30)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8
    )
    batch = replace(batch, softmax_scale=30.0)
    out = attention(*batch.args(), batch.softmax_scale)
    assert batch.softmax_scale * batch.query.abs().amax() ** 2 > 100  # logits are large
    assert_matches_reference(batch, out, tolerance=(2e-4, 1e-3))


def test_strided_query_and_given_out(attention: AttentionFn) -> None:
    """A query sliced out of a fused QKV tensor; ``out`` prefilled with junk is fully written."""
    base = build_batch(MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    fused = torch.randn(base.query.shape[0], 3 * 4, 64)
    fused[:, 4:8] = base.query
    query = fused[:, 4:8]  # strides (768, 64, 1): not contiguous
    assert not query.is_contiguous()
    batch = replace(base, query=query)
    out = torch.full_like(base.query, 123.0)
    returned = attention(*batch.args(), batch.softmax_scale, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert_matches_reference(batch, out)


def test_empty_batch(attention: AttentionFn) -> None:
    batch = build_batch(
        [Row(0, 0), Row(0, 5)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4
    )
    out = attention(*batch.args(), batch.softmax_scale)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("num_splits", [3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_kv_merge(interpreted_triton: None, num_splits: int, dtype: torch.dtype) -> None:
    """Flash-decoding splits, including splits that get no position (8 splits, <= 4 tiles)."""
    rows = [Row(1, 50), Row(1, 3), Row(0, 0), Row(3, 0), Row(4, 26)]
    batch = build_batch(rows, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=dtype)
    config = triton_attention.AttentionConfig(
        block_m=16, tile_n=16, num_splits=num_splits, num_warps=4, num_stages=1
    )
    out = triton_attention.paged_attention_triton(*batch.args(), batch.softmax_scale, config=config)
    assert_matches_reference(batch, out)


def test_query_tiles_span_rows(interpreted_triton: None) -> None:
    """Larger query tiles than rows: a tile never mixes rows and short rows waste no output."""
    rows = [Row(3, 9), Row(1, 2), Row(40, 45), Row(2, 2)]
    batch = build_batch(rows, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    config = triton_attention.AttentionConfig(
        block_m=32, tile_n=32, num_splits=1, num_warps=4, num_stages=1
    )
    out = triton_attention.paged_attention_triton(*batch.args(), batch.softmax_scale, config=config)
    assert_matches_reference(batch, out)


def test_torch_path_bounded_batches(torch_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With tiny memory bounds the torch path splits decode groups and query chunks; same result."""
    monkeypatch.setattr(torch_attention, "_MAX_GATHERED_POSITIONS", 40)
    monkeypatch.setattr(torch_attention, "_MAX_QUERY_CHUNK", 3)
    rows = [Row(1, 30), Row(1, 5), Row(1, 18), Row(1, 12), Row(8, 20), Row(1, 1)]
    batch = build_batch(rows, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    assert_matches_reference(batch, kernels.paged_attention(*batch.args(), batch.softmax_scale))


def test_torch_path_bfloat16(torch_backend: None) -> None:
    """bf16 on CPU takes the torch path (the interpreter refuses it): inputs are upcast, so the
    only error is storing the output in bf16, 2**-9 relative (tolerance 2e-2, 1e-2)."""
    batch = build_batch(
        MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=80, block_size=16, dtype=torch.bfloat16
    )
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale)
    assert_matches_reference(batch, out, tolerance=(2e-2, 1e-2))


# Windows against WINDOW_ROWS in blocks of 8: one position; edges inside blocks (5, 13: the
# context of a row); one block exactly (edges on block boundaries); longer than every context.
WINDOWS = [1, 5, 8, 13, 100]


def window_batch(
    sliding_window: int,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    rows: list[Row] = WINDOW_ROWS,
    block_size: int = 8,
) -> PagedBatch:
    batch = build_batch(
        rows, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=sliding_window,
    )  # fmt: skip
    return forget_before_window(batch, sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("sliding_window", WINDOWS)
def test_sliding_window_matches_reference(
    attention: AttentionFn, sliding_window: int, dtype: torch.dtype
) -> None:
    """Decode rows, prefill chunks with and without prior context, a chunk starting past the
    window, padding rows; windows shorter than, equal to and longer than the contexts."""
    batch = window_batch(sliding_window, dtype=dtype)
    out = attention(*batch.args(), batch.softmax_scale, sliding_window=sliding_window)
    assert_matches_reference(batch, out, sliding_window=sliding_window)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(8, 1, 80), (6, 2, 64), (4, 4, 32)],
    ids=["mqa8-d80", "gqa3", "mha-d32"],
)
def test_sliding_window_with_gqa(
    attention: AttentionFn, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    batch = window_batch(
        7, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=4
    )
    assert_matches_reference(
        batch, attention(*batch.args(), batch.softmax_scale, sliding_window=7), sliding_window=7
    )


# A scale and cap under which the cap bends most scores (|s| ~ 8 against c = 4): dropping it
# moves outputs by O(0.1), far outside every tolerance.
SOFTCAP_SCALE, SOFTCAP = 1.0, 4.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["causal", "window-8"])
def test_logit_softcap_matches_reference(
    attention: AttentionFn, sliding_window: int | None, dtype: torch.dtype
) -> None:
    if sliding_window is None:
        batch = build_batch(
            MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype
        )
    else:
        batch = window_batch(sliding_window, dtype=dtype)
    batch = replace(batch, softmax_scale=SOFTCAP_SCALE)
    options = {"sliding_window": sliding_window, "logit_softcap": SOFTCAP}
    out = attention(*batch.args(), batch.softmax_scale, **options)
    assert_matches_reference(batch, out, **options)
    uncapped = paged_attention_reference(*batch.args(), batch.softmax_scale, **options | {
        "logit_softcap": None
    })  # fmt: skip
    assert (out.double() - uncapped).abs().amax() > 0.1  # the cap is not a no-op here


@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_kv_with_sliding_window(interpreted_triton: None, num_splits: int) -> None:
    """Splits of a context that starts at the window: the first split begins at the window's
    first tile, and splits past the row's end stay empty."""
    rows = [Row(1, 50), Row(1, 3), Row(0, 0), Row(4, 26), Row(1, 64)]
    batch = window_batch(20, rows=rows, head_dim=64, num_q_heads=2, num_kv_heads=1)
    config = triton_attention.AttentionConfig(
        block_m=16, tile_n=16, num_splits=num_splits, num_warps=4, num_stages=1
    )
    out = triton_attention.paged_attention_triton(
        *batch.args(), batch.softmax_scale, config=config, sliding_window=20, logit_softcap=3.0
    )
    assert_matches_reference(batch, out, sliding_window=20, logit_softcap=3.0)


def test_query_tiles_span_windows(interpreted_triton: None) -> None:
    """A query tile of 16 tokens under a window of 5: later tokens of the tile see nothing of
    the first KV tiles (rows of the score matrix that stay -inf for whole tiles)."""
    rows = [Row(40, 45), Row(3, 9), Row(1, 2)]
    batch = window_batch(5, rows=rows, num_q_heads=2, num_kv_heads=1, block_size=4)
    config = triton_attention.AttentionConfig(
        block_m=32, tile_n=16, num_splits=1, num_warps=4, num_stages=1
    )
    out = triton_attention.paged_attention_triton(
        *batch.args(), batch.softmax_scale, config=config, sliding_window=5
    )
    assert_matches_reference(batch, out, sliding_window=5)


def test_torch_path_windows_in_bounded_batches(
    torch_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Query chunks of 3 (each starts its own window) and decode groups split by memory."""
    monkeypatch.setattr(torch_attention, "_MAX_GATHERED_POSITIONS", 12)
    monkeypatch.setattr(torch_attention, "_MAX_QUERY_CHUNK", 3)
    batch = window_batch(6, block_size=4)
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale, sliding_window=6)
    assert_matches_reference(batch, out, sliding_window=6)
    softcapped = kernels.paged_attention(
        *batch.args(), batch.softmax_scale, sliding_window=6, logit_softcap=2.0
    )
    assert_matches_reference(batch, softcapped, sliding_window=6, logit_softcap=2.0)


def test_torch_path_bfloat16_window_and_softcap(torch_backend: None) -> None:
    batch = replace(window_batch(8, dtype=torch.bfloat16), softmax_scale=SOFTCAP_SCALE)
    options = {"sliding_window": 8, "logit_softcap": SOFTCAP}
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale, **options)
    assert_matches_reference(batch, out, tolerance=(2e-2, 1e-2), **options)
