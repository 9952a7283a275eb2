# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (@triton.jit kernels cannot carry Python annotations: Triton reads them as kernel types.)
"""Triton kernels that move K/V inside the paged cache: ``write_kv`` and ``copy_slots``.

Both are pure data movement, one program per (token or slot pair, layer, KV head) copying one
``head_dim`` vector, so every load and store is a contiguous run. Slot arithmetic is int64:
``block_id * stride`` overflows int32 once a cache holds more than 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.attention_config import next_power_of_2
from kvgate.kernels.checks import check_copy_slots, check_write_kv
from kvgate.kernels.triton_common import require_matching_triton_mode


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided)
    slot_mapping_ptr,  # int64 [num_tokens]
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    in_dim = dims < HEAD_DIM

    k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dims, mask=in_dim)
    k_dst = block * stride_kc_block + offset * stride_kc_offset + head * stride_kc_head + dims
    tl.store(key_cache_ptr + k_dst, k, mask=in_dim)

    v = tl.load(
        value_ptr + token * stride_value_token + head * stride_value_head + dims, mask=in_dim
    )
    v_dst = block * stride_vc_block + offset * stride_vc_offset + head * stride_vc_head + dims
    tl.store(value_cache_ptr + v_dst, v, mask=in_dim)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> None:
    """Launch :func:`_write_kv_kernel`: one program per (token, KV head)."""
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    require_matching_triton_mode(_write_kv_kernel, key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=1,
    )


@triton.jit
def _copy_slots_kernel(
    key_cache_ptr,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    src_slots_ptr,  # int64 [n]
    dst_slots_ptr,  # int64 [n]
    stride_kc_block,
    stride_kc_layer,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_layer,
    stride_vc_offset,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    src = tl.load(src_slots_ptr + pair)
    dst = tl.load(dst_slots_ptr + pair)
    dims = tl.arange(0, HEAD_DIM_PAD)
    in_dim = dims < HEAD_DIM

    k_src = (
        (src // BLOCK_SIZE) * stride_kc_block
        + layer * stride_kc_layer
        + (src % BLOCK_SIZE) * stride_kc_offset
        + head * stride_kc_head
    )
    k_dst = (
        (dst // BLOCK_SIZE) * stride_kc_block
        + layer * stride_kc_layer
        + (dst % BLOCK_SIZE) * stride_kc_offset
        + head * stride_kc_head
    )
    k = tl.load(key_cache_ptr + k_src + dims, mask=in_dim)
    tl.store(key_cache_ptr + k_dst + dims, k, mask=in_dim)

    v_src = (
        (src // BLOCK_SIZE) * stride_vc_block
        + layer * stride_vc_layer
        + (src % BLOCK_SIZE) * stride_vc_offset
        + head * stride_vc_head
    )
    v_dst = (
        (dst // BLOCK_SIZE) * stride_vc_block
        + layer * stride_vc_layer
        + (dst % BLOCK_SIZE) * stride_vc_offset
        + head * stride_vc_head
    )
    v = tl.load(value_cache_ptr + v_src + dims, mask=in_dim)
    tl.store(value_cache_ptr + v_dst + dims, v, mask=in_dim)


def copy_slots_triton(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,  # int64 [n]
    dst_slots: torch.Tensor,  # int64 [n]
) -> None:
    """Launch :func:`_copy_slots_kernel`: one program per (slot pair, layer, KV head)."""
    check_copy_slots(key_cache, value_cache, src_slots, dst_slots)
    require_matching_triton_mode(_copy_slots_kernel, key_cache.device)
    num_pairs = src_slots.shape[0]
    _, num_layers, block_size, num_kv_heads, head_dim = key_cache.shape
    if num_pairs == 0 or num_layers == 0:
        return
    _copy_slots_kernel[(num_pairs, num_layers, num_kv_heads)](
        key_cache,
        value_cache,
        src_slots,
        dst_slots,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.stride(3),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        value_cache.stride(3),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=1,
    )
