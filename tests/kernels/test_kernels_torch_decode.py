"""Decode rows read straight from the cache (``torch_decode``) and the copy path it falls back to.

Both are checked against the float64 reference on NaN-poisoned caches (see ``paged_cases``): a
read of padding, of another layer or of an unwritten slot shows up as NaN.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvgate import kernels
from kvgate.kernels import torch_attention, torch_decode
from tests.kernels.paged_cases import MIXED_ROWS, PagedBatch, Row, build_batch
from tests.kernels.test_kernels_attention import assert_matches_reference

# Decode rows of unequal lengths (one group with a mask) next to a prefill chunk and padding.
DECODE_ROWS = [Row(1, 23), Row(1, 20), Row(0, 0), Row(4, 9), Row(1, 17), Row(2, 0), Row(1, 23)]


class CountingDecode:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        return torch_decode.decode_attention(*args)  # type: ignore[arg-type]


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> CountingDecode:
    spy = CountingDecode()
    monkeypatch.setattr(torch_attention, "decode_attention", spy)
    return spy


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa6"]
)
def test_reads_float32_cache_in_place(
    torch_backend: None, counting: CountingDecode, num_q_heads: int, num_kv_heads: int
) -> None:
    batch = build_batch(
        DECODE_ROWS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=4
    )
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale)
    assert counting.calls >= 1
    assert_matches_reference(batch, out)


def test_pieces_of_one_row(
    torch_backend: None, counting: CountingDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys gathered one row per piece give the same result as one piece for all rows."""
    monkeypatch.setattr(torch_decode, "_PIECE_BYTES", 1)
    batch = build_batch(DECODE_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    assert_matches_reference(batch, kernels.paged_attention(*batch.args(), batch.softmax_scale))
    assert counting.calls >= 1


def _unpacked(batch: PagedBatch) -> PagedBatch:
    """The same cache contents with head vectors 16 elements apart (NaN in between)."""
    padded = []
    for cache in (batch.key_cache_5d, batch.value_cache_5d):
        wide = torch.full((*cache.shape[:-1], cache.shape[-1] + 16), float("nan"))
        wide[..., : cache.shape[-1]] = cache
        padded.append(wide[..., : cache.shape[-1]])
    return replace(batch, key_cache_5d=padded[0], value_cache_5d=padded[1])


@pytest.mark.parametrize("layout", ["unpacked-fp32", "fp16"])
def test_other_caches_take_the_copy_path(
    torch_backend: None, counting: CountingDecode, layout: str
) -> None:
    dtype = torch.float16 if layout == "fp16" else torch.float32
    batch = build_batch(
        DECODE_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype
    )
    if layout == "unpacked-fp32":
        batch = _unpacked(batch)
        assert batch.key_cache.stride(2) == 80
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale)
    assert counting.calls == 0
    tolerance = (5e-3, 5e-3) if dtype == torch.float16 else None
    assert_matches_reference(batch, out, tolerance)


def test_row_table_addresses_the_view() -> None:
    """Row ``b * block_rows + o * Hkv + h`` of the table is the view's head vector (b, o, h)."""
    cache = torch.randn(5, 3, 4, 2, 8)  # [num_blocks, num_layers, block_size, Hkv, D]
    view = cache[:, 2]
    found = torch_decode.row_table(view)
    assert found is not None
    table, block_rows = found
    assert block_rows == 3 * 4 * 2
    for b, o, h in [(0, 0, 0), (4, 3, 1), (2, 1, 0)]:
        assert torch.equal(table[b * block_rows + o * 2 + h], view[b, o, h])
    assert torch_decode.row_table(view.half()) is None
    assert torch_decode.row_table(view.transpose(2, 1).contiguous().transpose(2, 1)) is None


def test_mixed_rows_fp32_use_the_direct_read(torch_backend: None, counting: CountingDecode) -> None:
    batch = build_batch(MIXED_ROWS, num_q_heads=8, num_kv_heads=2, head_dim=80, block_size=16)
    assert_matches_reference(batch, kernels.paged_attention(*batch.args(), batch.softmax_scale))
    assert counting.calls >= 1
