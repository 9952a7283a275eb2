"""Plain-torch references: the specification every kernel is tested against.

They are written as loops that read like the definitions, never for speed, and they do not
mutate their inputs: each returns new tensors. Attention is computed and returned in float64 so
that a kernel's error can be measured against (nearly) the exact answer.

Slot arithmetic used throughout::

    slot = block_id * block_size + offset        (offset in [0, block_size))
    context position p of row r  ->  block_tables[r, p // block_size], offset p % block_size
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # float64 [num_tokens, num_q_heads, head_dim]
    """Causal paged attention, one query token and one head at a time.

    Row ``r`` owns query tokens ``query_start_loc[r] .. query_start_loc[r+1]`` (``q_len`` of
    them). They are the last ``q_len`` positions of the row's context of ``seq_len`` positions::

        context  |0 1 2 ............ seq_len-q_len | ... seq_len-1|
                  \\______ prior context ________/ \\_ the queries _/

    Query ``i`` of the row sits at position ``p = seq_len - q_len + i`` and attends to positions
    ``0 ..= p``; with ``sliding_window = W`` only to ``p - W < k <= p`` (the last ``W``
    positions, itself included)::

        positions  0 ...... p-W | p-W+1 ...... p | p+1 ...
                   not visible  \\__ W visible _/  future

    A score is ``s = (q . k) * softmax_scale``; with ``logit_softcap = c`` it becomes
    ``c * tanh(s / c)`` before the softmax. Query head ``h`` reads KV head ``h // (num_q_heads
    // num_kv_heads)``. A row with ``seq_len == 0`` is padding: its tokens get zeros.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for row, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[row], starts[row + 1]
        q_len = q_end - q_begin
        if seq_len == 0 or q_len == 0:
            continue
        table = block_tables[row].tolist()

        def first_visible(position: int) -> int:
            return 0 if sliding_window is None else max(0, position - sliding_window + 1)

        # Only positions some query sees are read: blocks before the window may hold anything.
        row_first = first_visible(seq_len - q_len)
        keys = torch.stack(
            [key_cache[table[p // block_size], p % block_size] for p in range(row_first, seq_len)]
        ).to("cpu", torch.float64)  # [seq_len - row_first, num_kv_heads, head_dim]
        values = torch.stack(
            [value_cache[table[p // block_size], p % block_size] for p in range(row_first, seq_len)]
        ).to("cpu", torch.float64)
        for i in range(q_len):
            position = seq_len - q_len + i
            visible = slice(first_visible(position) - row_first, position + 1 - row_first)
            for head in range(num_q_heads):
                kv_head = head // group
                q = query[q_begin + i, head].to("cpu", torch.float64)
                k = keys[visible, kv_head]  # [visible, head_dim]
                scores = (k @ q) * softmax_scale
                if logit_softcap is not None:
                    scores = logit_softcap * torch.tanh(scores / logit_softcap)
                weights = torch.softmax(scores, dim=0)
                out[q_begin + i, head] = weights @ values[visible, kv_head]
    return out


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return copies of the caches with token ``t`` stored at ``slot_mapping[t]`` (if >= 0)."""
    new_keys, new_values = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        new_keys[slot // block_size, slot % block_size] = key[token]
        new_values[slot // block_size, slot % block_size] = value[token]
    return new_keys, new_values


def copy_slots_reference(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,  # int64 [n]
    dst_slots: torch.Tensor,  # int64 [n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return copies of the caches where every layer of slot ``dst[i]`` holds slot ``src[i]``."""
    new_keys, new_values = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[2]
    for src, dst in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
        for layer in range(key_cache.shape[1]):
            src_at = (src // block_size, layer, src % block_size)
            dst_at = (dst // block_size, layer, dst % block_size)
            new_keys[dst_at] = key_cache[src_at]
            new_values[dst_at] = value_cache[src_at]
    return new_keys, new_values


def gather_blocks_reference(
    cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # int64 [n]
) -> torch.Tensor:  # [n, num_layers, block_size, num_kv_heads, head_dim], on the CPU
    """Blocks ``block_ids`` of one cache, in order, copied to the CPU."""
    return (
        torch.stack([cache[b].to("cpu") for b in block_ids.tolist()])
        if len(block_ids)
        else (torch.empty((0, *cache.shape[1:]), dtype=cache.dtype))
    )


def scatter_blocks_reference(
    cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # int64 [n]
    host_blocks: torch.Tensor,  # [n, num_layers, block_size, num_kv_heads, head_dim]
) -> torch.Tensor:
    """Return a copy of ``cache`` whose block ``block_ids[i]`` holds ``host_blocks[i]``."""
    new_cache = cache.clone()
    for i, block in enumerate(block_ids.tolist()):
        new_cache[block] = host_blocks[i].to(cache.device)
    return new_cache
