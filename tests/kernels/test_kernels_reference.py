"""The references themselves, checked against computations that share no code with them.

``paged_attention_reference`` is compared with a dense, unpaged causal attention over each row's
contiguous K/V (``paged_cases.dense_causal_attention``), both in float64, to 1e-12: any
disagreement is a logic error, not rounding. The cache-op references are checked against
direct slot arithmetic.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.kernels.paged_cases import (
    MIXED_ROWS,
    WINDOW_ROWS,
    Row,
    build_batch,
    dense_causal_attention,
    forget_before_window,
)
from tests.kernels.reference import (
    copy_slots_reference,
    gather_blocks_reference,
    paged_attention_reference,
    scatter_blocks_reference,
    write_kv_reference,
)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_attention_reference_equals_dense(
    block_size: int, num_q_heads: int, num_kv_heads: int
) -> None:
    batch = build_batch(
        MIXED_ROWS,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float64,
        seed=block_size,
    )
    paged = paged_attention_reference(*batch.args(), batch.softmax_scale)
    dense = dense_causal_attention(batch)
    torch.testing.assert_close(paged, dense, atol=1e-12, rtol=1e-12)
    assert dense.abs().amax() > 0.1


def test_attention_reference_random_batches() -> None:
    rng = random.Random(7)
    for seed in range(20):
        rows = []
        for _ in range(rng.randint(1, 6)):
            seq_len = rng.choice([0, rng.randint(1, 40)])
            q_len = rng.randint(0, 3) if seq_len == 0 else rng.randint(0, seq_len)
            rows.append(Row(q_len, seq_len))
        batch = build_batch(
            rows,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=8,
            block_size=rng.choice([1, 2, 4, 8]),
            dtype=torch.float64,
            seed=seed,
        )
        paged = paged_attention_reference(*batch.args(), batch.softmax_scale)
        torch.testing.assert_close(paged, dense_causal_attention(batch), atol=1e-12, rtol=1e-12)


def test_dense_check_catches_a_wrong_causal_alignment() -> None:
    """The dense comparison is sharp: top-left causal alignment (a classic bug) is caught."""
    batch = build_batch(
        [Row(3, 10)], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float64
    )
    q = batch.query.transpose(0, 1)  # [heads, 3, d]
    k = batch.dense_keys[0].repeat_interleave(2, dim=1).transpose(0, 1)
    v = batch.dense_values[0].repeat_interleave(2, dim=1).transpose(0, 1)
    top_left = torch.ones(3, 10, dtype=torch.bool).tril()  # wrong: queries see too little
    scores = (q @ k.transpose(1, 2) * batch.softmax_scale).masked_fill(~top_left, float("-inf"))
    wrong = (scores.softmax(-1) @ v).transpose(0, 1)
    assert not torch.allclose(wrong, dense_causal_attention(batch), atol=1e-3)


@pytest.mark.parametrize("sliding_window", [1, 3, 8, 13, 100])
@pytest.mark.parametrize("logit_softcap", [None, 2.5])
def test_window_and_softcap_reference_equals_dense(
    sliding_window: int, logit_softcap: float | None
) -> None:
    """The reference reads only each query's window (the blocks before it are poisoned) and
    agrees with the dense band mask; 100 is longer than every context (full causal)."""
    batch = build_batch(
        WINDOW_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=torch.float64, seed=sliding_window,
    )  # fmt: skip
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    paged = paged_attention_reference(
        *forget_before_window(batch, sliding_window).args(), 2.0, **options
    )
    dense = dense_causal_attention(replace(batch, softmax_scale=2.0), **options)
    torch.testing.assert_close(paged, dense, atol=1e-12, rtol=1e-12)
    assert not paged.isnan().any()


def test_window_and_softcap_change_the_answer() -> None:
    """Each option is sharp: the window one position off, or the cap dropped, moves outputs
    by far more than any kernel tolerance (so kernel tests against the reference can fail)."""
    batch = build_batch(
        WINDOW_ROWS, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float64
    )
    at = {w: paged_attention_reference(*batch.args(), 1.0, sliding_window=w) for w in (7, 8, 9)}
    assert (at[8] - at[7]).abs().amax() > 1e-2 and (at[8] - at[9]).abs().amax() > 1e-2
    full = paged_attention_reference(*batch.args(), 1.0)
    assert torch.equal(paged_attention_reference(*batch.args(), 1.0, sliding_window=61), full)
    capped = paged_attention_reference(*batch.args(), 1.0, logit_softcap=2.0)
    assert (capped - full).abs().amax() > 1e-1


def test_write_kv_reference() -> None:
    cache = torch.zeros(3, 2, 1, 4)  # 3 blocks of 2 slots
    key = torch.arange(1.0, 13.0).view(3, 1, 4)
    new_k, new_v = write_kv_reference(key, -key, cache, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(new_k[2, 1], key[0]) and torch.equal(new_v[2, 1], -key[0])  # slot 5
    assert torch.equal(new_k[0, 0], key[2]) and torch.equal(new_v[0, 0], -key[2])  # slot 0
    written = torch.zeros(3, 2, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert torch.count_nonzero(new_k[~written]) == 0  # the padding token wrote nothing
    assert torch.count_nonzero(cache) == 0  # inputs are not mutated


def test_copy_slots_reference() -> None:
    cache = torch.arange(4 * 3 * 2 * 1 * 2, dtype=torch.float32).view(4, 3, 2, 1, 2)
    new_k, new_v = copy_slots_reference(
        cache, cache + 1, torch.tensor([1, 6]), torch.tensor([2, 7])
    )
    # slot 1 = block 0 offset 1 -> slot 2 = block 1 offset 0, every layer
    assert torch.equal(new_k[1, :, 0], cache[0, :, 1])
    assert torch.equal(new_k[3, :, 1], cache[3, :, 0])
    assert torch.equal(new_v[1, :, 0], cache[0, :, 1] + 1)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[1, :, 0] = False
    untouched[3, :, 1] = False
    assert torch.equal(new_k[untouched], cache[untouched])


def test_block_references_round_trip() -> None:
    cache = torch.randn(5, 2, 3, 1, 4)
    ids = torch.tensor([3, 0])
    host = gather_blocks_reference(cache, ids)
    assert torch.equal(host[0], cache[3]) and torch.equal(host[1], cache[0])
    moved = scatter_blocks_reference(torch.zeros_like(cache), torch.tensor([1, 4]), host)
    assert torch.equal(moved[1], cache[3]) and torch.equal(moved[4], cache[0])
    assert torch.count_nonzero(moved[0]) == 0
