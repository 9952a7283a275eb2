"""Vectorized torch implementations: what runs on CPU tensors when Triton is not interpreting.

The CPU executor runs these for every layer of every step, so they avoid per-token Python loops:
attention gathers each row's context out of the paged cache with one index operation and runs
batched matrix products in float32. Decode rows (one query each) are batched together; rows with
several queries run one at a time, in bounded query chunks, because padding a long prefill chunk
and a short decode row to one shape would waste memory quadratically.
"""

from __future__ import annotations

import torch

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
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    tables: torch.Tensor,  # int64 [n, max_blocks_per_row]
    lengths: torch.Tensor,  # int64 [n]
    max_len: int,
) -> torch.Tensor:  # float32 [n, max_len, num_kv_heads, head_dim]; zero past each length
    block_size = cache.shape[1]
    positions = torch.arange(max_len)
    block_index = positions // block_size  # [max_len]
    block_ids = tables[:, block_index]  # [n, max_len]
    in_context = positions[None, :] < lengths[:, None]  # [n, max_len]
    # Table entries past a row's context may hold anything: read block 0 there instead, then
    # zero those positions, since a masked score times a NaN from unwritten memory is NaN.
    block_ids = torch.where(in_context, block_ids, 0)
    offsets = (positions % block_size).expand_as(block_ids)
    gathered = cache[block_ids, offsets].to(torch.float32)
    return gathered.masked_fill_(~in_context[:, :, None, None], 0.0)


def _attend(
    query: torch.Tensor,  # float32 [n, q_len, num_q_heads, head_dim]
    keys: torch.Tensor,  # float32 [n, ctx, num_kv_heads, head_dim]
    values: torch.Tensor,  # float32 [n, ctx, num_kv_heads, head_dim]
    visible: torch.Tensor,  # bool [n, q_len, ctx]
    softmax_scale: float,
) -> torch.Tensor:  # float32 [n, q_len, num_q_heads, head_dim]
    """Masked grouped-query attention; every query must see at least one position."""
    n, q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    # Query heads of one KV head become extra query rows: [n, kv, group * q_len, d].
    q = query.view(n, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(n, num_kv_heads, group * q_len, head_dim)
    k = keys.permute(0, 2, 3, 1)  # [n, kv, d, ctx]
    v = values.permute(0, 2, 1, 3)  # [n, kv, ctx, d]
    scores = torch.matmul(q, k) * softmax_scale  # [n, kv, group * q_len, ctx]
    mask = visible[:, None, None, :, :].expand(n, num_kv_heads, group, q_len, keys.shape[1])
    scores = scores.masked_fill(~mask.reshape(scores.shape), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [n, kv, group * q_len, d]
    out = out.view(n, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n, q_len, num_q_heads, head_dim)


def paged_attention_torch(  # noqa: PLR0917 - mirrors paged_attention
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
        q = query[tokens].to(torch.float32)[:, None]  # [n, 1, heads, d]
        visible = (torch.arange(max_len)[None, :] < lengths[:, None])[:, None, :]
        result = _attend(q, keys, values, visible, softmax_scale)
        out[tokens] = result[:, 0].to(out.dtype)

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
            q = query[chunk_begin:chunk_end].to(torch.float32)[None]
            result = _attend(
                q,
                keys[:, :visible_len],
                values[:, :visible_len],
                visible[None],
                softmax_scale,
            )
            out[chunk_begin:chunk_end] = result[0].to(out.dtype)
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
