"""Decode attention read straight out of the paged cache: K in cache-sized pieces, V not copied.

A decode row has one query per head, so attention is memory-bound: the cost is how often the
row's K/V bytes travel. Gathering both into a padded tensor and handing it to SDPA moves them
three times (read, write the copy, read the copy). Here V is never copied and K's copy stays in
the L2 cache while it is read:

```
cache layer view [num_blocks, block_size, Hkv, D], head vectors contiguous, read as a table of
head vectors [rows, D]:    row(block, offset, kv_head) = block * block_rows + offset * Hkv + kv_head

keys   = index_select(table_k, key_rows)         [rows of a piece * Hkv, L, D]  (piece: ~1 MiB)
scores = (scale * q) @ keys^T                    [n * Hkv, group, L]            (piece by piece)
probs  = softmax(scores, masked past each row's length)                 = [n * Hq, L]
out    = embedding_bag(value_rows, table_v, per_sample_weights=probs)   = sum_p probs * V[row]
```

The row indices and the workspace (a piece's keys, the scores) are built on a step's first layer
and reused by the others.

A row reads only the positions its query sees: ``[0, len)``, or with a sliding window of ``W``
the last ``min(W, len)`` of them, so a long context under a small window costs the window.
Columns past a row's visible count (padding up to the group's widest row) read the row's first
visible position, which holds data: their score is masked to ``-inf``, so their weight is
exactly zero and ``0 * V`` is zero (a padding slot of unwritten memory, or a block before the
window that the cache has freed, could hold NaN, and ``0 * NaN`` is NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Gathered keys per piece: half of a typical 2 MiB per-core L2, so the copy is still cached
# when the score matmul reads it.
_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class DecodeSlots:
    """Where each visible context position of ``n`` decode rows (padded to ``max_len``) lives.

    Column ``j`` of row ``i`` is position ``firsts[i] + j`` while ``j < counts[i]``::

        row i   | firsts[i] ... firsts[i] + counts[i] - 1 | padding: reads firsts[i], hidden |
                 \\________ visible positions _________/

    The row indices depend on the cache view's strides, known only per call; they are computed
    on first use and kept for the other layers of the step (``_rows``).
    """

    block_ids: torch.Tensor  # int64 [n, max_len]; padding: the row's first visible position's
    offsets: torch.Tensor  # int64 [n, max_len]; offset in the block
    hidden: torch.Tensor | None  # bool [n, 1, max_len]: padding columns; None: there are none
    _rows: dict[tuple[int, int, int, int], _TableRows] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,  # int64 [n, max_blocks_per_row]
        firsts: torch.Tensor,  # int64 [n]: each row's first visible position
        counts: torch.Tensor,  # int64 [n], each >= 1: visible positions from there
        max_len: int,  # max(counts)
        block_size: int,
    ) -> DecodeSlots:
        columns = torch.arange(max_len)
        inside = columns[None, :] < counts[:, None]  # [n, max_len]
        # Entries of the table outside a row's visible positions may hold anything: padding
        # columns read the row's first visible position instead.
        positions = firsts[:, None] + torch.where(inside, columns[None, :], 0)
        block_ids = tables.gather(1, positions // block_size)
        offsets = positions % block_size
        hidden = None if bool(inside.all()) else ~inside[:, None, :]
        return cls(block_ids, offsets, hidden)

    def rows(self, block_rows: int, num_kv_heads: int, group: int, head_dim: int) -> _TableRows:
        """Table rows of every position's K and V for one cache layout (kept for later layers)."""
        key = (block_rows, num_kv_heads, group, head_dim)
        if key not in self._rows:
            self._rows[key] = _TableRows.build(self, block_rows, num_kv_heads, group, head_dim)
        return self._rows[key]


@dataclass(frozen=True)
class _Piece:
    """Rows ``[first_row, first_row + m)`` of a decode group: K gathered and scored together."""

    heads: int  # m * Hkv: the piece's rows of the [n * Hkv, group, D] query
    key_rows: torch.Tensor  # int64 [m * Hkv * max_len]
    keys: torch.Tensor  # float32 [m * Hkv * max_len, D], a view of the workspace
    keys_t: torch.Tensor  # float32 [m * Hkv, D, max_len], the same memory transposed
    scores: torch.Tensor  # float32 [m * Hkv, group, max_len], a view of the workspace


@dataclass(frozen=True)
class _TableRows:
    """Table rows of one decode group for one cache layout, and the group's workspace.

    The workspace (one piece's keys, every row's scores) and views into it are made once and
    reused by every layer: buffers of this size allocated per call would be mapped from the OS
    and page-faulted in each time, which costs as much as the copy itself.
    """

    pieces: tuple[_Piece, ...]
    value_rows: torch.Tensor  # int64 [n * Hq, max_len]
    scores: torch.Tensor  # float32 [n * Hkv, group, max_len]: scores, then probabilities

    @classmethod
    def build(
        cls, slots: DecodeSlots, block_rows: int, num_kv_heads: int, group: int, head_dim: int
    ) -> _TableRows:
        n, max_len = slots.block_ids.shape
        slot_rows = slots.block_ids * block_rows + slots.offsets * num_kv_heads
        key_rows = slot_rows[:, None, :] + torch.arange(num_kv_heads)[None, :, None]
        rows_per_piece = max(1, _PIECE_BYTES // (num_kv_heads * max_len * head_dim * 4))
        keys = torch.empty(min(rows_per_piece, n) * num_kv_heads * max_len, head_dim)
        scores = torch.empty(n * num_kv_heads, group, max_len)
        pieces = []
        for begin in range(0, n, rows_per_piece):
            heads = (min(begin + rows_per_piece, n) - begin) * num_kv_heads
            piece_keys = keys[: heads * max_len]
            pieces.append(
                _Piece(
                    heads=heads,
                    key_rows=key_rows[begin : begin + rows_per_piece].flatten(),
                    keys=piece_keys,
                    keys_t=piece_keys.view(heads, max_len, head_dim).transpose(1, 2),
                    scores=scores[begin * num_kv_heads : begin * num_kv_heads + heads],
                )
            )
        # Query head h reads KV head h // group: each KV head's rows repeat for its group.
        value_rows = key_rows.repeat_interleave(group, dim=1) if group > 1 else key_rows
        return cls(tuple(pieces), value_rows.flatten(0, 1), scores)


def row_table(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
) -> tuple[torch.Tensor, int] | None:  # ([rows, head_dim], block_rows) or None
    """The cache view as a table of head vectors, and the table rows between two blocks.

    ``None`` where that reading does not exist (head vectors not packed as ``[block_size, Hkv,
    D]`` inside a block, or a block stride that is not a whole number of rows) or does not pay
    (half precision: the copy path upcasts and accumulates in float32 instead).
    """
    num_kv_heads, head_dim = cache.shape[2:]
    block_stride, offset_stride, head_stride, dim_stride = cache.stride()
    packed = (dim_stride, head_stride, offset_stride) == (1, head_dim, num_kv_heads * head_dim)
    if cache.dtype != torch.float32 or not packed or block_stride % head_dim != 0:
        return None
    # Row r of the table starts r * head_dim elements after the view's first element, so the
    # view's element (b, o, h, :) is row b * block_stride / D + o * Hkv + h.
    elements = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()
    table = cache.as_strided((elements // head_dim, head_dim), (head_dim, 1))
    return table, block_stride // head_dim


def decode_attention(
    query: torch.Tensor,  # [n, num_q_heads, head_dim], float32
    key_table: torch.Tensor,  # [rows, head_dim] from row_table
    value_table: torch.Tensor,  # [rows, head_dim]
    block_rows: int,
    num_kv_heads: int,
    slots: DecodeSlots,
    softmax_scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # float32 [n, num_q_heads, head_dim]
    """One query per row over the row's visible positions (see the module docstring); with
    ``logit_softcap = c`` each score ``s`` becomes ``c * tanh(s / c)`` before the softmax."""
    n, num_q_heads, head_dim = query.shape
    group = num_q_heads // num_kv_heads
    max_len = slots.block_ids.shape[1]
    rows = slots.rows(block_rows, num_kv_heads, group, head_dim)
    # [n * Hkv, group, D]: query heads of one KV head side by side; the scale folded in once.
    q = (query * softmax_scale).view(n * num_kv_heads, group, head_dim)
    q_pieces = torch.split(q, [p.heads for p in rows.pieces])
    for piece, q_piece in zip(rows.pieces, q_pieces, strict=True):
        torch.index_select(key_table, 0, piece.key_rows, out=piece.keys)
        torch.bmm(q_piece, piece.keys_t, out=piece.scores)
    scores = rows.scores
    probs = scores.view(n, num_q_heads, max_len)
    if logit_softcap is not None:  # in place, like the softmax below
        probs.div_(logit_softcap).tanh_().mul_(logit_softcap)
    if slots.hidden is not None:
        probs.masked_fill_(slots.hidden, float("-inf"))
    # Softmax in place (a new tensor of this size would be page-faulted in, see _TableRows).
    probs -= probs.amax(dim=-1, keepdim=True)
    probs.exp_()
    probs /= probs.sum(dim=-1, keepdim=True)
    out = F.embedding_bag(
        rows.value_rows, value_table, mode="sum", per_sample_weights=probs.view(-1, max_len)
    )
    return out.view(n, num_q_heads, head_dim)
