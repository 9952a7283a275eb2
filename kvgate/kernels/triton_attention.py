# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (@triton.jit kernels cannot carry Python annotations: Triton reads them as kernel types.)
"""Triton paged attention for mixed batches: prefill chunks and decode rows in one launch.

Work decomposition (grid = ``(num_q_tiles, num_kv_heads, num_splits)``)::

    one program = one query tile of one row  x  one KV head  x  one split of the row's context

    query tile (BLOCK_M rows of the score matrix):
        m = token_in_tile * QUERIES_PER_KV + head_in_group      (GQA heads of one KV head share
        BLOCK_Q = BLOCK_M // QUERIES_PER_KV tokens per tile       every K/V tile they load)

    row r owns q tiles [first_tile(r), first_tile(r+1)), first_tile(r) = qsl[r] // BLOCK_Q + r

``first_tile`` over-counts by at most one tile per row, so the grid size
``num_tokens // BLOCK_Q + num_rows`` is known on the host without reading ``query_start_loc``;
a program finds its row by binary search and exits when its tile is past the row's queries.

Each program walks its KV positions in TILE_N steps (any block size: each position looks up its
own block id, int64 offsets), with an online softmax in the exp2 domain and float32
accumulators. With a sliding window the walk starts at the tile holding the first position the
program's first query sees (positions before it, and their block-table entries, are never
loaded), so a long context under a small window costs the window::

    row's context   0 ............................................................. seq_len
    tile's queries                                              | q_first ... q_last |
    walked                                [first visible of q_first ............... q_last]
                                          (from its TILE_N-aligned tile; masked below it)
 With ``num_splits > 1`` (few programs, e.g. small decode batches) the context is
cut into ``num_splits`` ranges whose normalised partial outputs and log-sum-exps are merged by
:func:`_merge_splits_kernel` (flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.attention_config import (
    MAX_HEAD_DIM,
    AttentionConfig,
    attention_constants,
    check_config,
    choose_config,
    next_power_of_2,
)
from kvgate.kernels.checks import (
    check_attention_metadata,
    check_attention_options,
    check_attention_shapes,
)
from kvgate.kernels.triton_common import require_matching_triton_mode

__all__ = ["AttentionConfig", "paged_attention_triton"]

_LOG2_E = 1.4426950408889634


@triton.jit
def _find_row(
    query_start_loc_ptr,  # int32 [num_rows + 1]
    num_rows,
    q_tile,
    BLOCK_Q: tl.constexpr,
):
    """Largest row r with ``qsl[r] // BLOCK_Q + r <= q_tile`` (-1 if none)."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    block_tables_ptr,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc_ptr,  # int32 [num_rows + 1]
    seq_lens_ptr,  # int32 [num_rows]
    split_out_ptr,  # float32 [num_splits, num_tokens, num_q_heads, HEAD_DIM_PAD] (splits > 1)
    split_lse_ptr,  # float32 [num_splits, num_tokens, num_q_heads] (log2 domain; splits > 1)
    scale_log2,  # softmax_scale * log2(e)
    num_rows,
    stride_out_token,
    stride_out_head,
    stride_q_token,
    stride_q_head,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    stride_table_row,
    stride_split_out_split,
    stride_split_out_token,
    stride_split_out_head,
    stride_split_lse_split,
    stride_split_lse_token,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # None: full causal
    LOGIT_SOFTCAP: tl.constexpr,  # None: no cap
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- which row and which of its query tokens this program owns
    row = _find_row(query_start_loc_ptr, num_rows, q_tile, BLOCK_Q)
    if row < 0:
        return
    row_q_begin = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - row_q_begin
    q_begin = (q_tile - (row_q_begin // BLOCK_Q + row)) * BLOCK_Q  # first query, row-relative
    if q_begin >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context_begin = seq_len - q_len  # context position of the row's first query

    offs_m = tl.arange(0, BLOCK_M)
    q_index = q_begin + offs_m // QUERIES_PER_KV  # row-relative query token of each tile row
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_index < q_len)
    token = (row_q_begin + q_index).to(tl.int64)
    q_position = context_begin + q_index  # causal limit: sees positions <= q_position
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = offs_d < HEAD_DIM

    q = tl.load(
        query_ptr
        + token[:, None] * stride_q_token
        + head[:, None] * stride_q_head
        + offs_d[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # -- the KV positions this program covers: [tile_begin, tile_end) * TILE_N, clipped to
    # [kv_begin, kv_end)
    last_q_exclusive = tl.minimum(q_begin + BLOCK_Q, q_len)
    kv_end = tl.maximum(tl.minimum(context_begin + last_q_exclusive, seq_len), 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SLIDING_WINDOW is not None:
        # The first position the program's first query sees: p - W < k.
        kv_begin = tl.maximum(context_begin + q_begin - SLIDING_WINDOW + 1, 0)
        first_tile = kv_begin // TILE_N
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_begin = first_tile + split * tiles_per_split
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    table_row_ptr = block_tables_ptr + row.to(tl.int64) * stride_table_row
    kv_head_k = kv_head.to(tl.int64) * stride_kc_head
    kv_head_v = kv_head.to(tl.int64) * stride_vc_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    for tile in range(tile_begin, tile_end):
        position = tile * TILE_N + tl.arange(0, TILE_N)
        position_valid = position < kv_end
        if SLIDING_WINDOW is not None:
            position_valid = position_valid & (position >= kv_begin)
        block_id = tl.load(table_row_ptr + position // BLOCK_SIZE, mask=position_valid, other=0).to(
            tl.int64
        )
        offset = position % BLOCK_SIZE
        k_slot = block_id * stride_kc_block + offset * stride_kc_offset + kv_head_k
        v_slot = block_id * stride_vc_block + offset * stride_vc_offset + kv_head_v
        k = tl.load(  # [HEAD_DIM_PAD, TILE_N]: already transposed for q @ k
            key_cache_ptr + k_slot[None, :] + offs_d[:, None],
            mask=position_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        v = tl.load(  # [TILE_N, HEAD_DIM_PAD]
            value_cache_ptr + v_slot[:, None] + offs_d[None, :],
            mask=position_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if LOGIT_SOFTCAP is not None:
            # c * tanh(s / c) in the log2 domain, tanh(y) = 1 - 2 / (exp(2y) + 1): exp2 of a
            # large score is inf (tanh 1), of a very negative one 0 (tanh -1), never NaN.
            grown = tl.math.exp2(
                tl.dot(q, k, input_precision=DOT_PRECISION) * (2.0 * scale_log2 / LOGIT_SOFTCAP)
            )
            scores = (LOGIT_SOFTCAP * 1.4426950408889634) * (1.0 - 2.0 / (grown + 1.0))
        else:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = (position[None, :] <= q_position[:, None]) & position_valid[None, :]
        if SLIDING_WINDOW is not None:
            visible = visible & (position[None, :] > q_position[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A tile row that has seen nothing yet keeps m = -inf; subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows that saw no position (padding rows, empty splits) have l == 0 and acc == 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr
            + token[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + offs_d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        split_base = split.to(tl.int64) * stride_split_out_split
        tl.store(
            split_out_ptr
            + split_base
            + token[:, None] * stride_split_out_token
            + head[:, None] * stride_split_out_head
            + offs_d[None, :],
            result,
            mask=row_valid[:, None],
        )
        tl.store(
            split_lse_ptr
            + split.to(tl.int64) * stride_split_lse_split
            + token * stride_split_lse_token
            + head,
            lse,
            mask=row_valid,
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    split_out_ptr,  # float32 [num_splits, num_tokens, num_q_heads, HEAD_DIM_PAD]
    split_lse_ptr,  # float32 [num_splits, num_tokens, num_q_heads]
    stride_out_token,
    stride_out_head,
    stride_split_out_split,
    stride_split_out_token,
    stride_split_out_head,
    stride_split_lse_split,
    stride_split_lse_token,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(
        split_lse_ptr + splits * stride_split_lse_split + token * stride_split_lse_token + head,
        mask=split_valid,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max)  # 0 for empty splits
    total = tl.sum(weight, axis=0)
    partial = tl.load(
        split_out_ptr
        + splits[:, None] * stride_split_out_split
        + token * stride_split_out_token
        + head * stride_split_out_head
        + offs_d[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    # Empty splits wrote no partial output, only lse = -inf; never multiply their slot.
    partial = tl.where(weight[:, None] > 0.0, partial, 0.0)
    result = tl.sum(partial * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + offs_d,
        result.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    softmax_scale: float,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Validate, pick a config (unless given: tests and benchmarks pin one) and launch."""
    check_attention_shapes(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, softmax_scale, out
    )
    check_attention_options(sliding_window, logit_softcap)
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} exceeds the kernel's maximum of {MAX_HEAD_DIM}")
    if query.device.type == "cpu" and query.dtype == torch.bfloat16:
        # Measured: the interpreter's bf16 dot products are off by orders of magnitude.
        raise ValueError(
            "the Triton interpreter computes bfloat16 attention wrongly: run bf16 on CUDA, or on "
            "CPU without TRITON_INTERPRET (the torch path)"
        )
    if query.device.type == "cpu":  # interpreted: reading the metadata costs nothing here
        check_attention_metadata(
            block_tables,
            query_start_loc,
            seq_lens,
            num_tokens,
            num_blocks,
            block_size,
            sliding_window=sliding_window,
        )
    require_matching_triton_mode(_paged_attention_kernel, query.device)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_rows = seq_lens.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    if config is None:
        sm_count = (
            torch.cuda.get_device_properties(query.device).multi_processor_count
            if query.device.type == "cuda"
            else None
        )
        config = choose_config(
            num_tokens=num_tokens,
            num_rows=num_rows,
            num_kv_heads=num_kv_heads,
            queries_per_kv=queries_per_kv,
            head_dim=head_dim,
            dtype=query.dtype,
            sm_count=sm_count,
        )
    check_config(config, queries_per_kv)
    constants = attention_constants(
        config=config,
        head_dim=head_dim,
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        dtype=query.dtype,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    head_dim_pad = constants["HEAD_DIM_PAD"]
    block_q = constants["BLOCK_Q"]
    grid = (num_tokens // block_q + num_rows, num_kv_heads, config.num_splits)
    if config.num_splits > 1:
        split_out = torch.empty(
            (config.num_splits, num_tokens, num_q_heads, head_dim_pad),
            dtype=torch.float32,
            device=query.device,
        )
        split_lse = torch.empty(
            (config.num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device
        )
    else:  # never read; any float32 tensor satisfies the signature
        split_out = split_lse = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        split_out,
        split_lse,
        softmax_scale * _LOG2_E,
        num_rows,
        out.stride(0),
        out.stride(1),
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        split_out.stride(0),
        split_out.stride(1),
        split_out.stride(2),
        split_lse.stride(0),
        split_lse.stride(1),
        **constants,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            split_out,
            split_lse,
            out.stride(0),
            out.stride(1),
            split_out.stride(0),
            split_out.stride(1),
            split_out.stride(2),
            split_lse.stride(0),
            split_lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=config.num_splits,
            SPLITS_PAD=next_power_of_2(config.num_splits),
            num_warps=4,
        )
    return out
