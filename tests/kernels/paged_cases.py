"""Builders for paged-attention test batches, plus an independent dense attention.

A batch is built the way the executor would leave it: each row's contiguous K/V is scattered into
blocks drawn from a shuffled free list (so block tables are non-contiguous and unordered) of a
5-D cache ``[num_blocks, num_layers, block_size, num_kv_heads, head_dim]``; attention runs on the
strided per-layer view ``cache[:, layer]``. Everything the kernels must never read is poisoned
with NaN (other layers, unused blocks, unused slots of used blocks) and block-table entries past
each row's context hold out-of-range ids, so a read outside the context shows up as NaN or a
crash instead of a plausible number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class Row:
    """``q_len`` new tokens at the end of a context of ``seq_len`` positions (0: padding)."""

    q_len: int
    seq_len: int


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache_5d: torch.Tensor  # [num_blocks, num_layers, block_size, num_kv_heads, head_dim]
    value_cache_5d: torch.Tensor
    layer: int
    block_tables: torch.Tensor  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor  # int32 [num_rows + 1]
    seq_lens: torch.Tensor  # int32 [num_rows]
    dense_keys: list[torch.Tensor]  # per row [seq_len, num_kv_heads, head_dim]
    dense_values: list[torch.Tensor]
    softmax_scale: float

    @property
    def key_cache(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.key_cache_5d[:, self.layer]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.value_cache_5d[:, self.layer]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
        )

    def to(self, device: str | torch.device) -> PagedBatch:
        return PagedBatch(
            self.query.to(device),
            self.key_cache_5d.to(device),
            self.value_cache_5d.to(device),
            self.layer,
            self.block_tables.to(device),
            self.query_start_loc.to(device),
            self.seq_lens.to(device),
            self.dense_keys,
            self.dense_values,
            self.softmax_scale,
        )


def build_batch(
    rows: list[Row],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
) -> PagedBatch:
    """A CPU batch over a NaN-poisoned cache with shuffled blocks (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [math.ceil(r.seq_len / block_size) for r in rows]
    num_blocks = sum(blocks_per_row) + spare_blocks
    shape = (num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max([*blocks_per_row, 1]) + 1  # one spare column: never read
    # Entries past a row's context point outside the cache: any read of them is an error.
    tables = torch.full((len(rows), max_blocks), num_blocks + 1000, dtype=torch.int32)
    dense_keys, dense_values = [], []
    for r, row in enumerate(rows):
        keys = torch.randn(row.seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(row.seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        dense_keys.append(keys)
        dense_values.append(values)
        for b in range(blocks_per_row[r]):
            block = free_blocks.pop()
            tables[r, b] = block
            span = slice(b * block_size, min((b + 1) * block_size, row.seq_len))
            fill = span.stop - span.start
            key_cache[block, layer, :fill] = keys[span]
            value_cache[block, layer, :fill] = values[span]
    q_lens = [r.q_len for r in rows]
    query_start_loc = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query=query,
        key_cache_5d=key_cache,
        value_cache_5d=value_cache,
        layer=layer,
        block_tables=tables,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor([r.seq_len for r in rows], dtype=torch.int32),
        dense_keys=dense_keys,
        dense_values=dense_values,
        softmax_scale=1.0 / math.sqrt(head_dim),
    )


def forget_before_window(batch: PagedBatch, sliding_window: int) -> PagedBatch:
    """``batch`` as a cache that dropped what no query sees: every position before the window
    of its row's first query is NaN-poisoned, and the block-table entries of the blocks lying
    wholly before it point outside the cache (as if freed, or never held after a prefix-cache
    hit). A kernel that reads any of them, instead of starting at the window, fails.
    """
    keys, values = batch.key_cache_5d.clone(), batch.value_cache_5d.clone()
    tables = batch.block_tables.clone()
    num_blocks, block_size = keys.shape[0], keys.shape[2]
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[r + 1] - starts[r]
        if seq_len == 0 or q_len == 0:
            continue
        first_seen = max(0, seq_len - q_len - sliding_window + 1)
        for position in range(first_seen):
            at = (int(tables[r, position // block_size]), batch.layer, position % block_size)
            keys[at] = values[at] = float("nan")
        tables[r, : first_seen // block_size] = num_blocks + 2000
    return PagedBatch(
        batch.query, keys, values, batch.layer, tables, batch.query_start_loc, batch.seq_lens,
        batch.dense_keys, batch.dense_values, batch.softmax_scale,
    )  # fmt: skip


def dense_causal_attention(
    batch: PagedBatch, *, sliding_window: int | None = None, logit_softcap: float | None = None
) -> torch.Tensor:  # float64 like the reference
    """Attention from the contiguous per-row K/V: no block tables, no paging, whole matrices.

    Written independently of ``reference.py`` (matrix form, explicit bottom-right mask as a band
    of diagonals, heads expanded with ``repeat_interleave``) so the two cannot share a mistake.
    """
    num_tokens, num_q_heads, head_dim = batch.query.shape
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        q_begin, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_begin
        if seq_len == 0 or q_len == 0:
            continue
        group = num_q_heads // batch.dense_keys[r].shape[1]
        k = batch.dense_keys[r].cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = batch.dense_values[r].cpu().double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = batch.query[q_begin:q_end].cpu().double().transpose(0, 1)  # [heads, q_len, d]
        scores = q @ k.transpose(1, 2) * batch.softmax_scale  # [heads, q_len, seq_len]
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        # Bottom-right causal: query i may see key j iff j <= i + (seq_len - q_len); under a
        # window of W also iff j >= i + (seq_len - q_len) - W + 1.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        if sliding_window is not None:
            mask = mask.triu(diagonal=seq_len - q_len - sliding_window + 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[q_begin:q_end] = (scores.softmax(dim=-1) @ v).transpose(0, 1)
    return out


# A mixed batch covering every row kind the executor produces (block_size-agnostic lengths).
MIXED_ROWS = [
    Row(q_len=1, seq_len=1),  # first decode step after a one-token prompt
    Row(q_len=1, seq_len=37),  # decode over several blocks
    Row(q_len=6, seq_len=6),  # prefill chunk without prior context
    Row(q_len=0, seq_len=0),  # empty padding row
    Row(q_len=5, seq_len=23),  # prefill chunk with prior context crossing block boundaries
    Row(q_len=2, seq_len=0),  # padding row with tokens: they must get zeros
    Row(q_len=0, seq_len=9),  # a row with context but no new token this step
    Row(q_len=1, seq_len=16),  # decode ending exactly on a block boundary (block_size 16)
    Row(q_len=17, seq_len=20),  # a chunk longer than one query tile
]

# For sliding windows (of 1 to a few blocks of 8): rows whose context is shorter than, equal to
# and longer than the window, with window edges inside blocks and on their boundaries.
WINDOW_ROWS = [
    Row(q_len=1, seq_len=1),  # a one-token prompt's decode step
    Row(q_len=1, seq_len=45),  # decode far past the window: early blocks never read
    Row(q_len=6, seq_len=6),  # prefill chunk without prior context
    Row(q_len=2, seq_len=0),  # padding row with tokens
    Row(q_len=5, seq_len=61),  # a later chunk starting past the window (as after a prefix hit)
    Row(q_len=0, seq_len=9),  # context but no new token
    Row(q_len=1, seq_len=16),  # decode ending on a block boundary
    Row(q_len=23, seq_len=40),  # a chunk whose first queries' windows reach into prior context
    Row(q_len=1, seq_len=13),  # decode: context equal to the window of 13
]
