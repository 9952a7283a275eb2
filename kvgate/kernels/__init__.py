"""Paged KV-cache kernels: attention over mixed prefill/decode batches, KV writes, plane copies
and block swaps.

One function per operation. Each validates its arguments (shapes, dtypes, strides, devices; and
values too when they are on the CPU) before writing anything, then runs on the backend that
:func:`kvgate.kernels.dispatch.select_backend` picks: Triton on CUDA, Triton's interpreter on CPU
under ``TRITON_INTERPRET=1``, vectorized torch on CPU otherwise. ``reference.py`` holds the loop
references that define every operation.

Cache layout: the executor keeps one K and one V tensor shaped
``[num_blocks, num_layers, block_size, num_kv_heads, head_dim]`` (a block holds every layer of
``block_size`` positions of one KV plane). ``paged_attention`` and ``write_kv`` take the per-layer
views ``cache[:, layer]`` (strided in dim 0); ``copy_slots`` and the block swaps take the full
5-D tensors. A slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch

from kvgate.kernels import blocks
from kvgate.kernels.checks import check_attention_metadata, check_attention_options
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.kernels.torch_attention import (
    AttentionPlan,
    paged_attention_torch,
    plan_attention_torch,
)
from kvgate.kernels.torch_ops import (
    WritePlan,
    copy_slots_torch,
    plan_write_kv_torch,
    write_kv_torch,
)

__all__ = [
    "AttentionPlan",
    "Backend",
    "WritePlan",
    "check_attention_metadata",
    "copy_slots",
    "gather_blocks",
    "paged_attention",
    "plan_attention",
    "plan_write_kv",
    "scatter_blocks",
    "select_backend",
    "write_kv",
]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1], cumulative query token offsets
    seq_lens: torch.Tensor,  # int32 [num_rows], context length including the row's new tokens
    softmax_scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim], query's dtype
    plan: AttentionPlan | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim], dtype of query
    """Causal attention of every row's queries over the row's paged context.

    Row ``r``'s queries ``query[query_start_loc[r]:query_start_loc[r+1]]`` (``q_len`` tokens) are
    the last ``q_len`` positions of its context; query ``i``, at position
    ``p = seq_len - q_len + i``, attends to positions ``0 ..= p`` (bottom-right aligned).
    Position ``p`` lives at ``key_cache[block_tables[r, p // block_size], p % block_size]``.
    Decode rows (``q_len == 1``), prefill chunks with or without prior context and padding rows
    (``seq_len == 0``: zeros) mix freely in one call. Query head ``h`` reads KV head
    ``h // (num_q_heads // num_kv_heads)``. Accumulation is float32 for every input dtype.

    ``sliding_window = W`` (an int >= 1; None: full causal): the query at ``p`` attends only to
    positions ``k`` with ``p - W < k <= p``, the last ``W`` positions including itself (fewer
    while ``p < W - 1``). This is transformers' convention (``masking_utils``:
    ``kv_idx > q_idx - sliding_window``, which Mistral, Gemma 2 and Gemma 3 use with their
    config's ``sliding_window``; flash-attn's ``window_size = (W - 1, 0)``). Blocks that lie
    wholly before the window of a row's first query are never read: their block-table entries
    may name freed blocks.

    ``logit_softcap = c`` (finite, > 0; None: no cap): every score
    ``s = (q . k) * softmax_scale`` becomes ``c * tanh(s / c)`` before the mask and the softmax
    (Gemma 2's ``attn_logit_softcapping``).

    On CUDA the metadata values are not read (that would stall every layer): run
    :func:`check_attention_metadata` once per step where the input is not trusted. ``plan`` is
    what :func:`plan_attention` returned for these same metadata tensors and this same
    ``sliding_window``: the CPU path then skips reading and checking them again on every layer.
    """
    if select_backend(query.device) is Backend.TORCH:
        return paged_attention_torch(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            softmax_scale,
            out,
            plan,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
    # Deferred: Triton reads TRITON_INTERPRET when the kernels are defined (see dispatch).
    from kvgate.kernels.triton_attention import paged_attention_triton  # noqa: PLC0415

    return paged_attention_triton(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        softmax_scale,
        out,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


def plan_attention(
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    *,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    compiled: bool = False,
    per_token: bool = False,
    sliding_window: int | None = None,
) -> AttentionPlan | None:
    """Prepare one step's metadata for every layer's :func:`paged_attention` call.

    The metadata of a step is the same for every layer. The CPU torch path checks its values
    here, once, and precomputes its gather indices and masks; the result is ``None`` where the
    backend needs no plan (Triton, which reads the metadata on the device and must not stall the
    stream to read it on the host). The tensors must not be changed while the plan is in use.
    ``compiled`` (CPU): decode rows on the compiled kernel of :mod:`kvgate.kernels.cpu` (loaded
    by the caller; the executor does where its model runs the compiled layer operations).
    ``per_token`` (compiled only): prefill tokens summed as decode rows are, for the executor's
    batch-invariant mode. ``sliding_window``: the window of the calls that will use the plan
    (what a query reads depends on it); layers with different windows need one plan each, and a
    call whose window differs from its plan's is refused.
    """
    check_attention_options(sliding_window, None)
    if select_backend(block_tables.device) is not Backend.TORCH:
        if per_token:
            raise ValueError("per-token attention runs on the CPU's compiled kernel only")
        return None
    return plan_attention_torch(
        block_tables,
        query_start_loc,
        seq_lens,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        compiled=compiled,
        per_token=per_token,
        sliding_window=sliding_window,
    )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; slot = block_id * block_size + offset
    plan: WritePlan | None = None,
) -> None:
    """Store token ``t``'s K/V at ``slot_mapping[t]``; negative slots (padding) are skipped.

    Non-negative slots must be distinct (checked when they are on the CPU: on every call, or
    once in :func:`plan_write_kv`, whose result ``plan`` then is).
    """
    if select_backend(key.device) is Backend.TORCH:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping, plan)
        return
    # Deferred: Triton reads TRITON_INTERPRET when the kernels are defined (see dispatch).
    from kvgate.kernels.triton_cache import write_kv_triton  # noqa: PLC0415

    write_kv_triton(key, value, key_cache, value_cache, slot_mapping)


def plan_write_kv(
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    *,
    num_blocks: int,
    block_size: int,
    compiled: bool = False,
) -> WritePlan | None:
    """Prepare one step's slot mapping for every layer's :func:`write_kv` call.

    The slots of a step are the same for every layer: the CPU torch path checks their values
    here, once (the check sorts them), and splits them into block and offset indices. ``None``
    where the backend needs no plan (Triton: the slots stay on the device, unread).
    ``compiled`` (CPU): float32 writes on :mod:`kvgate.kernels.cpu`'s kernel (loaded).
    """
    if select_backend(slot_mapping.device) is not Backend.TORCH:
        return None
    return plan_write_kv_torch(
        slot_mapping, num_blocks=num_blocks, block_size=block_size, compiled=compiled
    )


def copy_slots(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # int64 [n]
    dst_slots: torch.Tensor,  # int64 [n]
) -> None:
    """Copy every layer's K/V of slot ``src_slots[i]`` into slot ``dst_slots[i]``.

    Used by LAST_EXITED finalization to copy an early-exited token's K/V into deeper planes.
    Destinations must be distinct and no slot may be both a source and a destination (checked
    when the slots are on the CPU), so the result does not depend on copy order.
    """
    if select_backend(key_cache.device) is Backend.TORCH:
        copy_slots_torch(key_cache, value_cache, src_slots, dst_slots)
        return
    # Deferred: Triton reads TRITON_INTERPRET when the kernels are defined (see dispatch).
    from kvgate.kernels.triton_cache import copy_slots_triton  # noqa: PLC0415

    copy_slots_triton(key_cache, value_cache, src_slots, dst_slots)


def gather_blocks(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # int64 [n], distinct
) -> tuple[torch.Tensor, torch.Tensor]:  # host [n, num_layers, block_size, num_kv_heads, head_dim]
    """Copy whole blocks to host tensors (pinned when the cache is on CUDA); see ``blocks``."""
    return blocks.gather_blocks(key_cache, value_cache, block_ids)


def scatter_blocks(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # int64 [n], distinct
    host_keys: torch.Tensor,  # [n, num_layers, block_size, num_kv_heads, head_dim]
    host_values: torch.Tensor,
) -> None:
    """Write host blocks from :func:`gather_blocks` into (newly allocated) ``block_ids``."""
    blocks.scatter_blocks(key_cache, value_cache, block_ids, host_keys, host_values)
