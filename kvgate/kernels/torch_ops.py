"""Vectorized torch KV writes and slot copies: what runs on CPU tensors when Triton is not
interpreting (attention is in ``torch_attention``).

The CPU executor runs these for every layer of every step, so they avoid per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.kernels import cpu
from kvgate.kernels.checks import check_copy_slots, check_slot_mapping, check_write_kv


@dataclass(frozen=True)
class WritePlan:
    """One step's slot mapping, checked once and split into (block, offset) for every layer.

    A call that passes the plan must pass the same ``slot_mapping`` object, unchanged.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens], as planned
    num_blocks: int
    block_size: int
    keep: torch.Tensor | None  # bool [num_tokens]: tokens with a slot; None: every token
    at: tuple[torch.Tensor, torch.Tensor]  # int64 (block ids, offsets) of the kept tokens
    compiled: bool  # float32 writes on the compiled kernel (kvgate.kernels.cpu)

    def require_matches(self, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if slot_mapping is not self.slot_mapping:
            raise ValueError("plan was made for another slot_mapping tensor")
        if tuple(key_cache.shape[:2]) != (self.num_blocks, self.block_size):
            raise ValueError(
                f"plan was made for (num_blocks, block_size) = "
                f"{(self.num_blocks, self.block_size)}, got {tuple(key_cache.shape[:2])}"
            )


def plan_write_kv_torch(
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
    *,
    num_blocks: int,
    block_size: int,
    compiled: bool = False,
) -> WritePlan:
    """Check the slots' values once and precompute the index tensors every layer writes to.

    ``compiled``: float32 writes on the compiled kernel (``kvgate.kernels.cpu``, loaded).
    """
    if compiled and not cpu.loaded():
        raise ValueError("compiled KV writes asked for, but kvgate.kernels.cpu is not loaded")
    check_slot_mapping(slot_mapping, num_slots=num_blocks * block_size)
    keep = None
    slots = slot_mapping
    if bool((slot_mapping < 0).any()):  # padding tokens: drop them (rare; masking copies)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
    at = (slots // block_size, slots % block_size)
    return WritePlan(slot_mapping, num_blocks, block_size, keep, at, compiled)


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
    plan: WritePlan | None = None,
) -> None:
    """Same contract as :func:`kvgate.kernels.write_kv`, with torch index assignment."""
    check_write_kv(key, value, key_cache, value_cache, slot_mapping, check_values=plan is None)
    if plan is None:
        plan = plan_write_kv_torch(
            slot_mapping, num_blocks=key_cache.shape[0], block_size=key_cache.shape[1]
        )
    else:
        plan.require_matches(key_cache, slot_mapping)
    tensors = (key, value, key_cache, value_cache)
    same_layout = key_cache.stride() == value_cache.stride()
    fp32 = all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    if plan.compiled and same_layout and fp32:
        # Padding tokens (negative slots) are skipped by the kernel itself.
        torch.ops.kvgate_cpu.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    if plan.keep is not None:
        key, value = key[plan.keep], value[plan.keep]
    # index_put_ writes through views, so per-layer views of a 5-D cache work.
    key_cache.index_put_(plan.at, key)
    value_cache.index_put_(plan.at, value)


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
