"""The executor's paged KV cache: one K and one V tensor for every layer and plane.

```
keys, values: [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
              a physical block holds block_size consecutive positions of ONE plane, every layer
slot(plane d, position p) = block_tables[d-1][p // block_size] * block_size + p % block_size
```
The scheduler owns block ids; the cache only holds the tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvgate.executor.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across every layer."""
    elements = config.num_layers * block_size * config.num_kv_heads * config.head_dim
    return 2 * elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        shape = (num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_block = bytes_per_block(config, block_size, dtype)
        self._layers = [(self.keys[:, i], self.values[:, i]) for i in range(config.num_layers)]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided per-layer views ``[num_blocks, block_size, Hkv, D]`` for the kernels."""
        return self._layers[layer]


def blocks_for_memory_fraction(
    config: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_fraction: float,
    profile: Callable[[], None],
) -> int:
    """How many blocks fit in ``memory_fraction`` of the GPU after a profiling forward.

    ``profile`` runs the largest forward the executor will run; its peak allocation, plus memory
    held outside torch's allocator (CUDA context, other processes), is kept free of KV blocks.
    """
    if device.type != "cuda":
        raise ValueError("memory-fraction sizing needs a CUDA device; pass num_blocks on CPU")
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    budget = int(total * memory_fraction) - outside_torch - peak
    num_blocks = budget // bytes_per_block(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"no KV block fits: {memory_fraction:.0%} of {total / 2**30:.1f} GiB minus the "
            f"{peak / 2**30:.2f} GiB profiling peak leaves {budget / 2**30:.2f} GiB"
        )
    return int(num_blocks)
