"""The compiled kernels on a CUDA GPU (marked ``gpu``; skipped without one).

Run: ``pytest -m gpu tests/kernels`` (or ``benchmarks/gpu_check.sh``). Tolerances against the
float64 reference as in ``test_kernels_attention.py``, plus bfloat16 — (3e-2, 2e-2): bf16 keeps
8 mantissa bits, so storing the output costs up to 2**-9 relative (about 8e-3 at |out| ~ 4) and
the probabilities rounded to bf16 for the P·V product add about as much again. float32 runs
with IEEE (not tf32) tensor-core products, so its tolerance stays (2e-5, 1e-5) even over contexts
of a thousand positions, where accumulation error grows like sqrt(n) ulps.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvgate import kernels
from kvgate.kernels import triton_attention
from tests.kernels.paged_cases import (
    MIXED_ROWS,
    PagedBatch,
    Row,
    build_batch,
    dense_causal_attention,
    forget_before_window,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]

TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# Mixed rows plus long ones: chunks spanning several query tiles over long prior context.
GPU_ROWS = [*MIXED_ROWS, Row(1, 1000), Row(130, 700), Row(257, 257), Row(1, 4097)]


def check(
    batch_cpu: PagedBatch,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    # The dense attention is the reference's vectorized twin (test_kernels_reference.py shows
    # they agree to 1e-12) and is fast enough for thousands of positions.
    expected = dense_causal_attention(
        batch_cpu, sliding_window=sliding_window, logit_softcap=logit_softcap
    )
    atol, rtol = TOLERANCES[batch_cpu.query.dtype]
    assert out.is_cuda and out.dtype == batch_cpu.query.dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


HEAD_SHAPES = {
    "mha-128": (8, 8, 128),
    "gqa4-80": (8, 2, 80),
    "gqa8-128": (32, 4, 128),
    "mqa-96": (16, 1, 96),
    "gqa2-256": (4, 2, 256),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEAD_SHAPES.values(), ids=HEAD_SHAPES.keys())
def test_attention_matches_reference(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    """The launcher's own config choice, over every row kind and long contexts."""
    num_q_heads, num_kv_heads, head_dim = heads
    batch = build_batch(
        GPU_ROWS,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    check(batch, kernels.paged_attention(*batch.to("cuda").args(), batch.softmax_scale))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [1, 2, 32, 64])
def test_attention_block_sizes(dtype: torch.dtype, block_size: int) -> None:
    batch = build_batch(
        GPU_ROWS, num_q_heads=8, num_kv_heads=2, head_dim=80, block_size=block_size, dtype=dtype
    )
    check(batch, kernels.paged_attention(*batch.to("cuda").args(), batch.softmax_scale))


@pytest.mark.parametrize("num_splits", [1, 2, 7, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_splits(num_splits: int, dtype: torch.dtype) -> None:
    rows = [Row(1, n) for n in (1, 17, 640, 4096, 3000, 64)]
    batch = build_batch(
        rows, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype
    )
    config = triton_attention.AttentionConfig(16, 64, num_splits, num_warps=4, num_stages=2)
    out = triton_attention.paged_attention_triton(
        *batch.to("cuda").args(), batch.softmax_scale, config=config
    )
    check(batch, out)


@pytest.mark.parametrize(
    "config",
    [
        triton_attention.AttentionConfig(128, 64, 1, num_warps=8, num_stages=3),
        triton_attention.AttentionConfig(64, 32, 1, num_warps=4, num_stages=2),
        triton_attention.AttentionConfig(32, 128, 4, num_warps=4, num_stages=2),
    ],
    ids=["prefill", "small", "split"],
)
def test_prefill_configs(config: triton_attention.AttentionConfig) -> None:
    batch = build_batch(
        GPU_ROWS, num_q_heads=16, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16
    )
    out = triton_attention.paged_attention_triton(
        *batch.to("cuda").args(), batch.softmax_scale, config=config
    )
    check(batch, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("sliding_window", "logit_softcap"),
    [(1, None), (100, None), (1024, None), (None, 5.0), (100, 5.0)],
    ids=["window-1", "window-100", "window-1024", "softcap", "window-100-softcap"],
)
def test_sliding_window_and_softcap(
    dtype: torch.dtype, sliding_window: int | None, logit_softcap: float | None
) -> None:
    """Windows of one position, inside a block, and of many blocks over contexts up to 4097,
    the positions before each row's window poisoned and unlisted (never read); the soft-cap at
    a scale where it bends most scores."""
    batch = build_batch(
        GPU_ROWS, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype
    )
    if sliding_window is not None:
        batch = forget_before_window(batch, sliding_window)
    if logit_softcap is not None:
        batch = replace(batch, softmax_scale=0.5)
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    out = kernels.paged_attention(*batch.to("cuda").args(), batch.softmax_scale, **options)
    check(batch, out, **options)
    for num_splits in (1, 5):  # the split walk starts at the window's first tile too
        config = triton_attention.AttentionConfig(64, 32, num_splits, num_warps=4, num_stages=2)
        out = triton_attention.paged_attention_triton(
            *batch.to("cuda").args(), batch.softmax_scale, config=config, **options
        )
        check(batch, out, **options)


def test_cache_ops_match_torch_on_gpu() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (64, 3, 16, 4, 128)
    key_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    value_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    expected_k, expected_v = key_cache.cpu(), value_cache.cpu()
    key = torch.randn(50, 4, 128, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(64 * 16, generator=gen)[:50]
    slots[::7] = -1  # padding tokens
    keep = slots >= 0
    expected_k[slots[keep] // 16, 2, slots[keep] % 16] = key[keep]
    expected_v[slots[keep] // 16, 2, slots[keep] % 16] = -key[keep]
    kernels.write_kv(key.cuda(), (-key).cuda(), key_cache[:, 2], value_cache[:, 2], slots.cuda())
    assert torch.equal(key_cache.cpu(), expected_k) and torch.equal(value_cache.cpu(), expected_v)

    src = torch.tensor([5, 6, 100, 101])
    dst = torch.tensor([700, 900, 901, 17])
    expected_k[dst // 16, :, dst % 16] = expected_k[src // 16, :, src % 16]
    kernels.copy_slots(key_cache, value_cache, src.cuda(), dst.cuda())
    assert torch.equal(key_cache.cpu(), expected_k)

    host_k, host_v = kernels.gather_blocks(key_cache, value_cache, torch.tensor([3, 9]).cuda())
    assert host_k.is_pinned() and host_v.is_pinned()
    assert torch.equal(host_k, expected_k[[3, 9]])
    kernels.scatter_blocks(key_cache, value_cache, torch.tensor([60, 61]).cuda(), host_k, host_v)
    torch.cuda.synchronize()
    assert torch.equal(key_cache[60].cpu(), expected_k[3])
    assert torch.equal(value_cache[61].cpu(), value_cache[9].cpu())


def test_offsets_beyond_int32() -> None:
    """Blocks whose element offset exceeds 2**31 (a ~4.6 GB per-cache tensor, fp16).

    K/V are written with ``write_kv`` into the top blocks of layer 1, read back by attention,
    copied with ``copy_slots`` and swapped with the block helpers: any int32 offset wraps and
    reads or writes the wrong (NaN-filled) memory.
    """
    num_blocks, num_layers, block_size, num_kv_heads, head_dim = 70_000, 2, 16, 8, 128
    shape = (num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    value_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    layer_stride = key_cache[:, 1].stride(0)
    first_block = 2**31 // layer_stride + 1  # every block from here on overflows int32
    assert first_block < num_blocks - 200

    rows = [Row(1, 300), Row(40, 200), Row(0, 0), Row(1, 33)]
    gen = torch.Generator().manual_seed(1)
    blocks = (first_block + torch.randperm(num_blocks - first_block, generator=gen))[:200]
    max_blocks = max(math.ceil(r.seq_len / block_size) for r in rows)
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    dense_keys, dense_values, slot_lists = [], [], []
    used = 0
    for r, row in enumerate(rows):
        n_blocks = math.ceil(row.seq_len / block_size)
        tables[r, :n_blocks] = blocks[used : used + n_blocks].to(torch.int32)
        used += n_blocks
        positions = torch.arange(row.seq_len)
        slot_lists.append(
            tables[r, positions // block_size].long() * block_size + positions % block_size
        )
        dense_keys.append(torch.randn(row.seq_len, num_kv_heads, head_dim, generator=gen).half())
        dense_values.append(torch.randn(row.seq_len, num_kv_heads, head_dim, generator=gen).half())
    kernels.write_kv(
        torch.cat(dense_keys).cuda(),
        torch.cat(dense_values).cuda(),
        key_cache[:, 1],
        value_cache[:, 1],
        torch.cat(slot_lists).cuda(),
    )
    q_lens = [r.q_len for r in rows]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 32, head_dim, generator=gen).half()
    batch = PagedBatch(
        query=query,
        key_cache_5d=key_cache,
        value_cache_5d=value_cache,
        layer=1,
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.tensor([r.seq_len for r in rows], dtype=torch.int32),
        dense_keys=dense_keys,
        dense_values=dense_values,
        softmax_scale=head_dim**-0.5,
    )
    expected = dense_causal_attention(batch)
    for num_splits in (1, 4):
        config = triton_attention.AttentionConfig(64, 64, num_splits, num_warps=4, num_stages=2)
        out = triton_attention.paged_attention_triton(
            query.cuda(),
            key_cache[:, 1],
            value_cache[:, 1],
            tables.cuda(),
            starts.cuda(),
            batch.seq_lens.cuda(),
            batch.softmax_scale,
            config=config,
        )
        torch.testing.assert_close(out.cpu().double(), expected, atol=5e-3, rtol=5e-3)

    # Plane copy between two overflowing blocks, then a swap round trip of those blocks.
    src, dst = slot_lists[0][:5], blocks[-1].long() * block_size + torch.arange(5)
    kernels.copy_slots(key_cache, value_cache, src.cuda(), dst.cuda())
    copied = key_cache[int(blocks[-1]), 1, :5].cpu()
    assert torch.equal(copied, dense_keys[0][:5])
    ids = torch.tensor([int(tables[0, 0]), int(blocks[-1])])
    host_k, host_v = kernels.gather_blocks(key_cache, value_cache, ids.cuda())
    new_ids = blocks[-3:-1].long()
    kernels.scatter_blocks(key_cache, value_cache, new_ids.cuda(), host_k, host_v)
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}  # layer 0 is still NaN
    torch.testing.assert_close(key_cache[new_ids.cuda()].cpu(), host_k, **exact)
    torch.testing.assert_close(value_cache[new_ids.cuda()].cpu(), host_v, **exact)
    assert torch.equal(host_k[1, 1, :5], dense_keys[0][:5])


def test_large_batch_matches_torch_path() -> None:
    """A step-sized batch: 200 decode rows and 3 prefill chunks against the CPU torch path."""
    gen = torch.Generator().manual_seed(2)
    rows = [Row(1, int(n)) for n in torch.randint(1, 3000, (200,), generator=gen)]
    rows += [Row(512, 512), Row(512, 2048), Row(77, 1500)]
    batch = build_batch(
        rows, num_q_heads=16, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.float16
    )
    out = kernels.paged_attention(*batch.to("cuda").args(), batch.softmax_scale)
    expected = kernels.paged_attention(*batch.args(), batch.softmax_scale)  # CPU torch path
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=5e-3, rtol=5e-3)
