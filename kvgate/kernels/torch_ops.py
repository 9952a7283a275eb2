"""Vectorized torch KV writes and slot copies: what runs on CPU tensors when Triton is not
interpreting (attention is in ``torch_attention``).

The CPU executor runs these for every layer of every step, so they avoid per-token Python loops.
"""

from __future__ import annotations

import torch

from kvgate.kernels.checks import check_copy_slots, check_write_kv


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> None:
    """Same contract as :func:`kvgate.kernels.write_kv`, with torch index assignment."""
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping
    if bool((slot_mapping < 0).any()):  # padding tokens: drop them (rare; masking copies)
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep], key[keep], value[keep]
    block_size = key_cache.shape[1]
    at = (slots // block_size, slots % block_size)
    # index_put_ writes through views, so per-layer views of a 5-D cache work.
    key_cache.index_put_(at, key)
    value_cache.index_put_(at, value)


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
