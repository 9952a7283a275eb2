"""Block swap for snapshots: whole blocks (every layer) between the device cache and the host.

Plain torch index operations: a block is one contiguous slab of
``num_layers * block_size * num_kv_heads * head_dim`` elements of the 5-D cache, so
``index_select``/``index_copy_`` already move it at copy-engine speed and a custom kernel would
add nothing. On CUDA the host side is pinned memory so the copies run as DMA transfers.
"""

from __future__ import annotations

import torch

from kvgate.kernels.checks import check_block_ids, check_host_blocks


def gather_blocks(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # int64 [n], distinct
) -> tuple[torch.Tensor, torch.Tensor]:  # host [n, num_layers, block_size, num_kv_heads, head_dim]
    """Copy blocks ``block_ids`` of both caches to new host tensors (pinned if the cache is CUDA).

    Returns once the data is on the host, so the caller may free or reuse the blocks at once.
    """
    check_block_ids(key_cache, value_cache, block_ids)
    ids = block_ids.to(key_cache.device)
    pin = key_cache.device.type == "cuda"
    host: list[torch.Tensor] = []
    for cache in (key_cache, value_cache):
        buffer = torch.empty(
            (ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device="cpu", pin_memory=pin
        )
        # Blocking copy: the blocks may be handed to another request right after this returns.
        buffer.copy_(cache.index_select(0, ids))
        host.append(buffer)
    return host[0], host[1]


def scatter_blocks(
    key_cache: torch.Tensor,  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # int64 [n], distinct
    host_keys: torch.Tensor,  # [n, num_layers, block_size, num_kv_heads, head_dim]
    host_values: torch.Tensor,
) -> None:
    """Write host blocks (as returned by :func:`gather_blocks`) into blocks ``block_ids``.

    The copy is ordered on the current stream before any later kernel that reads the blocks.
    """
    check_block_ids(key_cache, value_cache, block_ids)
    check_host_blocks(key_cache, host_keys, host_values, num_ids=block_ids.shape[0])
    ids = block_ids.to(key_cache.device)
    for cache, host in ((key_cache, host_keys), (value_cache, host_values)):
        non_blocking = cache.device.type == "cuda" and host.is_pinned()
        cache.index_copy_(0, ids, host.to(cache.device, non_blocking=non_blocking))
