"""The per-step attention plan (``kernels.plan_attention``) of the CPU torch path.

A plan is made once per step from the step's metadata and passed to every layer's
``paged_attention``: results must equal the reference on every layer, a plan must not be usable
with other metadata or another cache geometry, and its decode groups must stay bounded.
"""

from __future__ import annotations

import pytest
import torch

from kvgate import kernels
from kvgate.kernels import torch_attention
from tests.kernels.paged_cases import MIXED_ROWS, PagedBatch, Row, build_batch
from tests.kernels.test_kernels_attention import assert_matches_reference


def _plan(batch: PagedBatch, sliding_window: int | None = None) -> kernels.AttentionPlan | None:
    return kernels.plan_attention(
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        num_tokens=batch.query.shape[0],
        num_blocks=batch.key_cache.shape[0],
        block_size=batch.key_cache.shape[1],
        sliding_window=sliding_window,
    )


def _layer_batch(base: PagedBatch, layer: int, seed: int) -> PagedBatch:
    """``base`` with other keys and values written into ``layer`` of the same blocks."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = base.key_cache_5d.clone(), base.value_cache_5d.clone()
    keys[:, layer] = torch.randn(keys[:, layer].shape, generator=gen)
    values[:, layer] = torch.randn(values[:, layer].shape, generator=gen)
    dense_keys, dense_values = [], []
    block_size = keys.shape[2]
    for r, seq_len in enumerate(base.seq_lens.tolist()):
        ids = base.block_tables[r, : -(-seq_len // block_size)].long()
        dense_keys.append(keys[ids, layer].flatten(0, 1)[:seq_len])
        dense_values.append(values[ids, layer].flatten(0, 1)[:seq_len])
    return PagedBatch(
        base.query, keys, values, layer, base.block_tables, base.query_start_loc,
        base.seq_lens, dense_keys, dense_values, base.softmax_scale,
    )  # fmt: skip


def test_one_plan_serves_every_layer(torch_backend: None) -> None:
    base = build_batch(
        MIXED_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4, num_layers=3
    )
    plan = _plan(base)
    assert isinstance(plan, kernels.AttentionPlan)
    for layer in range(3):
        batch = _layer_batch(base, layer, seed=layer) if layer != base.layer else base
        out = torch.full_like(batch.query, 123.0)  # every token is written, padding with zeros
        kernels.paged_attention(*batch.args(), batch.softmax_scale, out=out, plan=plan)
        assert_matches_reference(batch, out)


def test_plan_must_come_from_the_same_metadata(torch_backend: None) -> None:
    batch = build_batch(MIXED_ROWS, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    plan = _plan(batch)
    equal_copy = batch.block_tables.clone()
    with pytest.raises(ValueError, match="other metadata tensors"):
        kernels.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, equal_copy,
            batch.query_start_loc, batch.seq_lens, batch.softmax_scale, plan=plan,
        )  # fmt: skip


def test_plan_must_fit_the_cache(torch_backend: None) -> None:
    batch = build_batch(MIXED_ROWS, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    plan = _plan(batch)
    bigger = torch.cat([batch.key_cache_5d, batch.key_cache_5d])[:, batch.layer]
    out = torch.full_like(batch.query, 7.0)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        kernels.paged_attention(
            batch.query, bigger, bigger, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.softmax_scale, out=out, plan=plan,
        )  # fmt: skip
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_plan_is_made_for_one_window(torch_backend: None) -> None:
    """Layers with a sliding window and global layers need a plan each: a plan used with
    another window than its own would read the wrong positions, so it is refused."""
    batch = build_batch(MIXED_ROWS, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    plans = {window: _plan(batch, sliding_window=window) for window in (None, 8)}
    for window, plan in plans.items():
        out = kernels.paged_attention(
            *batch.args(), batch.softmax_scale, plan=plan, sliding_window=window
        )
        assert_matches_reference(batch, out, sliding_window=window)
    with pytest.raises(ValueError, match="made for sliding_window=None, the call asks for 8"):
        kernels.paged_attention(*batch.args(), 1.0, plan=plans[None], sliding_window=8)
    with pytest.raises(ValueError, match="made for sliding_window=8, the call asks for None"):
        kernels.paged_attention(*batch.args(), 1.0, plan=plans[8])


def test_plan_checks_metadata_values(torch_backend: None) -> None:
    batch = build_batch([Row(1, 9)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    tables = batch.block_tables.clone()
    tables[0, 1] = 10_000
    with pytest.raises(ValueError, match="is outside"):
        kernels.plan_attention(
            tables, batch.query_start_loc, batch.seq_lens,
            num_tokens=1, num_blocks=batch.key_cache.shape[0], block_size=4,
        )  # fmt: skip


def test_no_plan_for_triton(interpreted_triton: None) -> None:
    """Triton reads the metadata on the device: nothing to plan on the host."""
    batch = build_batch([Row(1, 9)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    assert _plan(batch) is None


def test_decode_groups_bound_padding(torch_backend: None) -> None:
    """Short decode rows are not padded to a long row's length; results are unchanged."""
    rows = [Row(1, 3), Row(1, 90), Row(1, 5), Row(1, 4), Row(1, 85), Row(2, 7)]
    batch = build_batch(rows, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    plan = _plan(batch)
    assert isinstance(plan, kernels.AttentionPlan)
    # Sorted by length: {3, 4, 5} and {85, 90}; never all five padded to 90.
    shapes = [tuple(g.slots.block_ids.shape) for g in plan.decode_groups]
    assert shapes == [(3, 5), (2, 90)]
    out = kernels.paged_attention(*batch.args(), batch.softmax_scale, plan=plan)
    assert_matches_reference(batch, out)


def test_decode_rows_in_order_read_query_as_a_slice(torch_backend: None) -> None:
    """Equal-length decode rows stay in token order (no index copies) and need no mask: the
    NaN-poisoned rest of each last block lies past ``max_len`` and is never read."""
    batch = build_batch(
        [Row(5, 20)] + [Row(1, 37)] * 4, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=8
    )
    plan = _plan(batch)
    assert isinstance(plan, kernels.AttentionPlan)
    (group,) = plan.decode_groups
    assert group.tokens == slice(5, 9) and group.slots.hidden is None
    assert group.slots.block_ids.shape == (4, 37)
    assert_matches_reference(batch, kernels.paged_attention(*batch.args(), 1 / 8, plan=plan))


def test_padding_bound_is_what_splits(torch_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no padding bound the same rows form one group (the test above can fail)."""
    monkeypatch.setattr(torch_attention, "_MAX_PADDING_FACTOR", 1000)
    rows = [Row(1, 3), Row(1, 90), Row(1, 5)]
    batch = build_batch(rows, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    plan = _plan(batch)
    assert isinstance(plan, kernels.AttentionPlan)
    assert len(plan.decode_groups) == 1
    assert_matches_reference(batch, kernels.paged_attention(*batch.args(), 0.125, plan=plan))
