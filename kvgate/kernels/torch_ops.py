"""Vectorized torch implementations: what runs on CPU tensors when Triton is not interpreting.

The CPU executor runs these for every layer of every step, so they avoid per-token Python loops:
attention gathers each row's context out of the paged cache with one index operation over whole
blocks and runs torch's fused ``scaled_dot_product_attention`` in float32 (grouped-query heads
natively). Decode rows (one query each) are batched together; rows with several queries run one
at a time, in bounded query chunks, because padding a long prefill chunk and a short decode row
to one shape would waste memory quadratically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.kernels.checks import (
    check_attention_metadata,
    check_attention_shapes,
    check_copy_slots,
    check_write_kv,
)

# Upper bound on gathered context positions (rows x padded length) per batched decode group and
# on query tokens per prefill chunk: keeps peak memory near a few hundred MiB at 32 heads x 128.
_MAX_GATHERED_POSITIONS = 1 << 20
_MAX_QUERY_CHUNK = 128


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    tables: torch.Tensor,  # int64 [n, max_blocks_per_row]
    lengths: torch.Tensor,  # int64 [n]
    max_len: int,
) -> torch.Tensor:  # float32 [n, num_kv_heads, max_len, head_dim], zero past each length
    """Rows' contexts as contiguous head-major float32 tensors, copied block by block."""
    n = tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_table_blocks = -(-max_len // block_size)
    block_starts = torch.arange(num_table_blocks) * block_size
    # Table entries past a row's context may hold anything, even out-of-range ids: read block 0.
    block_ids = torch.where(
        block_starts[None, :] < lengths[:, None], tables[:, :num_table_blocks], 0
    )
    blocks = cache[block_ids]  # [n, num_table_blocks, block_size, num_kv_heads, head_dim]
    positions = blocks.view(n, num_table_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]
    context = positions.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
    past_end = torch.arange(max_len)[None, :] >= lengths[:, None]  # [n, max_len]
    if bool(past_end.any()):
        # Masked scores give exact zero weights, but 0 * NaN from unwritten memory is NaN.
        context.masked_fill_(past_end[:, None, :, None], 0.0)
    return context


def _attend(
    query: torch.Tensor,  # float32 [n, num_q_heads, q_len, head_dim]
    keys: torch.Tensor,  # float32 [n, num_kv_heads, ctx, head_dim]
    values: torch.Tensor,  # float32 [n, num_kv_heads, ctx, head_dim]
    visible: torch.Tensor | None,  # bool [n, 1, q_len, ctx]; None: every position visible
    softmax_scale: float,
) -> torch.Tensor:  # float32 [n, num_q_heads, q_len, head_dim]
    """Masked grouped-query attention; every query must see at least one position."""
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=visible, scale=softmax_scale, enable_gqa=True
    )


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kvgate.kernels.paged_attention`, for CPU tensors."""
    check_attention_shapes(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, softmax_scale, out
    )
    check_attention_metadata(
        block_tables,
        query_start_loc,
        seq_lens,
        num_tokens=query.shape[0],
        num_blocks=key_cache.shape[0],
        block_size=key_cache.shape[1],
    )
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    out.zero_()  # padding rows (seq_len == 0) keep these zeros
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(torch.int64)
    decode_rows = [r for r, n in enumerate(lens) if n > 0 and starts[r + 1] - starts[r] == 1]
    chunk_rows = [r for r, n in enumerate(lens) if n > 0 and starts[r + 1] - starts[r] > 1]

    # Decode rows: sorted by length so each batch pads little, batches bounded in memory.
    decode_rows.sort(key=lambda r: lens[r])
    while decode_rows:
        max_len = lens[decode_rows[0]]
        take = 0
        for r in decode_rows:
            max_len = max(max_len, lens[r])
            if (take + 1) * max_len > _MAX_GATHERED_POSITIONS and take > 0:
                break
            take += 1
        batch, decode_rows = decode_rows[:take], decode_rows[take:]
        max_len = max(lens[r] for r in batch)
        rows = torch.tensor(batch)
        lengths = torch.tensor([lens[r] for r in batch])
        keys = _gather_context(key_cache, tables[rows], lengths, max_len)
        values = _gather_context(value_cache, tables[rows], lengths, max_len)
        tokens = torch.tensor([starts[r] for r in batch])
        q = query[tokens].to(torch.float32)[:, :, None]  # [n, heads, 1, d]
        visible = None
        if bool((lengths < max_len).any()):
            visible = (torch.arange(max_len)[None, :] < lengths[:, None])[:, None, None, :]
        result = _attend(q, keys, values, visible, softmax_scale)
        out[tokens] = result[:, :, 0].to(out.dtype)

    # Rows with several queries (prefill chunks), in bounded query chunks.
    for r in chunk_rows:
        seq_len, q_begin, q_end = lens[r], starts[r], starts[r + 1]
        first_position = seq_len - (q_end - q_begin)
        lengths = torch.tensor([seq_len])
        keys = _gather_context(key_cache, tables[r : r + 1], lengths, seq_len)
        values = _gather_context(value_cache, tables[r : r + 1], lengths, seq_len)
        for chunk_begin in range(q_begin, q_end, _MAX_QUERY_CHUNK):
            chunk_end = min(chunk_begin + _MAX_QUERY_CHUNK, q_end)
            # Query token t sits at context position first_position + (t - q_begin).
            positions = first_position + torch.arange(chunk_begin - q_begin, chunk_end - q_begin)
            visible_len = int(positions[-1]) + 1
            visible = torch.arange(visible_len)[None, :] <= positions[:, None]
            q = query[chunk_begin:chunk_end].to(torch.float32).transpose(0, 1)[None]
            result = _attend(
                q,
                keys[:, :, :visible_len],
                values[:, :, :visible_len],
                visible[None, None],
                softmax_scale,
            )
            out[chunk_begin:chunk_end] = result[0].transpose(0, 1).to(out.dtype)
    return out


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> None:
    """Same contract as :func:`kvgate.kernels.write_kv`, with torch index assignment."""
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    # Indexing assignment writes through views, so per-layer views of a 5-D cache work.
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


def copy_slots_torch(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,  # int64 [n]
    dst_slots: torch.Tensor,  # int64 [n]
) -> None:
    """Same contract as :func:`kvgate.kernels.copy_slots`, with torch index operations."""
    check_copy_slots(key_cache, value_cache, src_slots, dst_slots)
    block_size = key_cache.shape[2]
    src_blocks, src_offsets = src_slots // block_size, src_slots % block_size
    dst_blocks, dst_offsets = dst_slots // block_size, dst_slots % block_size
    for cache in (key_cache, value_cache):
        # cache[b, :, o] with index tensors b, o: [n, num_layers, num_kv_heads, head_dim].
        cache[dst_blocks, :, dst_offsets] = cache[src_blocks, :, src_offsets]
