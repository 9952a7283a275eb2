"""write_kv, copy_slots and the block swaps on CPU, against their references.

These only move data, so every backend must match the reference bit for bit in every dtype
(tolerance zero). bf16 is included: loads and stores of bf16 are exact in the interpreter; only
its arithmetic is not, and these kernels do none.
"""

from __future__ import annotations

import pytest
import torch

from kvgate import kernels
from tests.kernels.reference import (
    copy_slots_reference,
    gather_blocks_reference,
    scatter_blocks_reference,
    write_kv_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture(params=["triton-interpreted", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(
        "interpreted_triton" if request.param == "triton-interpreted" else "torch_backend"
    )
    return str(request.param)


def random_cache(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``[num_blocks, num_layers, block_size, num_kv_heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_into_a_layer_view(backend: str, dtype: torch.dtype, block_size: int) -> None:
    """Scatter into ``cache[:, 1]`` (strided); layer 0, padding tokens and other slots untouched."""
    key_cache, value_cache = random_cache((5, 2, block_size, 2, 80), dtype, seed=block_size)
    num_slots = 5 * block_size
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_slots, generator=gen)[:4]
    slot_mapping = torch.tensor(
        [int(slots[0]), -1, int(slots[1]), int(slots[2]), -7, int(slots[3])]
    )
    key = torch.randn(6, 2, 80, generator=gen).to(dtype)
    value = torch.randn(6, 2, 80, generator=gen).to(dtype)
    expected_k, expected_v = write_kv_reference(
        key, value, key_cache[:, 1], value_cache[:, 1], slot_mapping
    )
    layer0_k = key_cache[:, 0].clone()
    kernels.write_kv(key, value, key_cache[:, 1], value_cache[:, 1], slot_mapping)
    assert torch.equal(key_cache[:, 1], expected_k)
    assert torch.equal(value_cache[:, 1], expected_v)
    assert torch.equal(key_cache[:, 0], layer0_k)


def test_write_kv_strided_inputs(backend: str) -> None:
    """K and V sliced out of one fused projection output (non-contiguous token stride)."""
    key_cache, value_cache = random_cache((3, 1, 4, 2, 64), torch.float16, seed=1)
    fused = torch.randn(5, 3, 2, 64).to(torch.float16)  # q, k, v
    key, value = fused[:, 1], fused[:, 2]
    slot_mapping = torch.tensor([11, 0, 5, -1, 7])
    expected_k, expected_v = write_kv_reference(
        key, value, key_cache[:, 0], value_cache[:, 0], slot_mapping
    )
    kernels.write_kv(key, value, key_cache[:, 0], value_cache[:, 0], slot_mapping)
    assert torch.equal(key_cache[:, 0], expected_k)
    assert torch.equal(value_cache[:, 0], expected_v)


def test_write_kv_no_tokens(backend: str) -> None:
    key_cache, value_cache = random_cache((2, 1, 4, 1, 64), torch.float32, seed=2)
    before = key_cache.clone()
    empty = torch.empty(0, 1, 64)
    kernels.write_kv(
        empty, empty, key_cache[:, 0], value_cache[:, 0], torch.empty(0, dtype=torch.int64)
    )
    assert torch.equal(key_cache, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_slots_across_planes(backend: str, dtype: torch.dtype) -> None:
    """Copy a token's K/V from a plane-1 block into plane-2 and plane-3 blocks, all layers."""
    block_size = 4
    key_cache, value_cache = random_cache((9, 3, block_size, 2, 96), dtype, seed=5)
    # block 2 (plane 1) -> blocks 7 and 4 (planes 2, 3); offsets 1 and 3
    src = torch.tensor([2 * block_size + 1, 2 * block_size + 1, 2 * block_size + 3])
    dst = torch.tensor([7 * block_size + 1, 4 * block_size + 1, 7 * block_size + 3])
    expected_k, expected_v = copy_slots_reference(key_cache, value_cache, src, dst)
    assert not torch.equal(expected_k, key_cache)
    kernels.copy_slots(key_cache, value_cache, src, dst)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_copy_slots_nothing_to_copy(backend: str) -> None:
    key_cache, value_cache = random_cache((2, 2, 4, 1, 64), torch.float32, seed=6)
    before = key_cache.clone()
    none = torch.empty(0, dtype=torch.int64)
    kernels.copy_slots(key_cache, value_cache, none, none)
    assert torch.equal(key_cache, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_then_scatter_is_bit_exact(dtype: torch.dtype) -> None:
    key_cache, value_cache = random_cache((6, 2, 4, 2, 64), dtype, seed=7)
    ids = torch.tensor([4, 1, 5])
    host_k, host_v = kernels.gather_blocks(key_cache, value_cache, ids)
    assert host_k.device.type == "cpu" and host_k.shape == (3, 2, 4, 2, 64)
    assert torch.equal(host_k, gather_blocks_reference(key_cache, ids))
    assert torch.equal(host_v, gather_blocks_reference(value_cache, ids))
    # The snapshot survives the blocks being overwritten, then lands in new blocks.
    original_k = key_cache.clone()
    key_cache[ids] = 0
    new_ids = torch.tensor([0, 2, 3])
    expected_k = scatter_blocks_reference(key_cache, new_ids, host_k)
    expected_v = scatter_blocks_reference(value_cache, new_ids, host_v)
    kernels.scatter_blocks(key_cache, value_cache, new_ids, host_k, host_v)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
    assert torch.equal(key_cache[0], original_k[4])


def test_gather_no_blocks() -> None:
    key_cache, value_cache = random_cache((2, 1, 4, 1, 64), torch.float32, seed=8)
    host_k, host_v = kernels.gather_blocks(
        key_cache, value_cache, torch.empty(0, dtype=torch.int64)
    )
    assert host_k.shape == (0, 1, 4, 1, 64) and host_v.shape == (0, 1, 4, 1, 64)
