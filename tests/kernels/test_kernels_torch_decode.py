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
from tests.kernels.paged_cases import (
    MIXED_ROWS,
    PagedBatch,
    Row,
    build_batch,
    forget_before_window,
)
from tests.kernels.test_kernels_attention import SOFTCAP, assert_matches_reference

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


# Decode rows longer than, equal to and shorter than a window of 9 (blocks of 4: the edge falls
# inside a block), next to a prefill chunk and padding.
WINDOW_DECODE_ROWS = [Row(1, 40), Row(1, 9), Row(0, 0), Row(4, 30), Row(1, 5), Row(1, 23)]


@pytest.mark.parametrize("logit_softcap", [None, SOFTCAP], ids=["causal", "softcap"])
@pytest.mark.parametrize("layout", ["packed-fp32", "unpacked-fp32", "fp16"])
def test_decode_rows_read_only_their_window(
    torch_backend: None, counting: CountingDecode, layout: str, logit_softcap: float | None
) -> None:
    """In place (packed float32) and by copy (other caches): each row reads its last 9
    positions, from the first visible one (the blocks before it are poisoned and unlisted)."""
    dtype = torch.float16 if layout == "fp16" else torch.float32
    batch = build_batch(
        WINDOW_DECODE_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype
    )
    batch = replace(forget_before_window(batch, 9), softmax_scale=1.0)
    if layout == "unpacked-fp32":
        batch = _unpacked(batch)
        assert batch.key_cache.stride(2) == 80
    out = kernels.paged_attention(
        *batch.args(), batch.softmax_scale, sliding_window=9, logit_softcap=logit_softcap
    )
    assert counting.calls == (1 if layout == "packed-fp32" else 0)
    tolerance = (5e-3, 5e-3) if dtype == torch.float16 else (2e-5, 2e-5)
    assert_matches_reference(batch, out, tolerance, sliding_window=9, logit_softcap=logit_softcap)


def test_window_groups_pad_to_the_window(torch_backend: None) -> None:
    """A decode group is as wide as its widest row's window, not its longest context."""
    batch = build_batch(
        [Row(1, 300), Row(1, 250), Row(1, 3)], num_q_heads=2, num_kv_heads=1, head_dim=64,
        block_size=8,
    )  # fmt: skip
    plan = kernels.plan_attention(
        batch.block_tables, batch.query_start_loc, batch.seq_lens, num_tokens=3,
        num_blocks=batch.key_cache.shape[0], block_size=8, sliding_window=16,
    )  # fmt: skip
    assert isinstance(plan, kernels.AttentionPlan)
    assert [tuple(g.slots.block_ids.shape) for g in plan.decode_groups] == [(3, 16)]
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale, plan=plan, sliding_window=16)
    assert_matches_reference(batch, out, sliding_window=16)
