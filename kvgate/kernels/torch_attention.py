"""Paged attention in vectorized torch: what runs on CPU tensors when Triton is not interpreting.

Two phases. :func:`plan_attention_torch` reads the step's metadata once (block tables, query
offsets, lengths: the same for every layer of a step) and turns it into an :class:`AttentionPlan`
of index tensors and masks. :func:`paged_attention_torch` then runs one layer with that plan and
touches no Python lists:

* on a plan made with ``compiled=True``, where the caches are float32: every row, decode and
  prefill alike, in one call of the compiled kernel (``kvgate.kernels.cpu``), which reads K and
  V in place through the block tables, each query token up to its own position. Otherwise:
* decode rows (one query each) sorted by length and batched in groups bounded in memory and in
  padding: :mod:`torch_decode` reads them straight from the cache (float32 caches whose head
  vectors are packed, which is how the executor lays them out); otherwise each position's K/V is
  gathered, upcast to float32 and handed to torch's ``scaled_dot_product_attention``;
* rows with several queries (prefill chunks), one at a time in bounded query chunks, because
  padding a long chunk and a short decode row to one shape would waste memory quadratically: the
  row's whole blocks are gathered with one ``index_select`` each for K and V and read by SDPA as
  a strided view:

```
cache layer view  [num_blocks, block_size, Hkv, D]  (strided in dim 0: other layers between)
  index_select(0, block_ids[blocks_per_row])      -> [blocks_per_row, block_size, Hkv, D]
  view, [:seq_len], transpose                     -> [1, Hkv, seq_len, D]   (no copy)
```

A plan made with ``sliding_window = W`` reads only what its queries see (``p - W < k <= p``):
decode rows their last ``W`` positions, prefill rows the blocks from the one holding their first
query's first visible position, each query chunk the positions from its own first query's. So a
long context under a small window costs the window, and blocks wholly before a row's window are
never read (the cache may have freed them). ``logit_softcap`` (``c * tanh(s / c)`` on every
score) leaves SDPA, which cannot cap, for :func:`_softcapped_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from kvgate.kernels import cpu
from kvgate.kernels.checks import (
    check_attention_metadata,
    check_attention_options,
    check_attention_shapes,
    first_visible_position,
)
from kvgate.kernels.torch_decode import DecodeSlots, decode_attention, row_table

# Upper bound on context positions (rows x padded length) per decode group. A group holds about
# 16 + 8 Hkv + 12 Hq bytes per position when read in place (32 MiB at 32 query / 8 KV heads), and
# 8 Hkv D bytes per position when copied (half-precision caches: 512 MiB at 8 KV heads x 128).
_MAX_GATHERED_POSITIONS = 1 << 16
# Query tokens per SDPA call of a prefill chunk (bounds the [q, context] score matrix).
_MAX_QUERY_CHUNK = 128
# A decode group may gather at most this many times the positions its rows actually hold, so one
# long row does not pad a group of short ones to its length.
_MAX_PADDING_FACTOR = 2


@dataclass(frozen=True)
class _DecodeGroup:
    tokens: torch.Tensor | slice  # query tokens of the group's rows, in row order
    slots: DecodeSlots


@dataclass(frozen=True)
class _QueryChunk:
    tokens: slice  # query tokens of one row
    seen: slice  # the positions any of them sees, as indices into the row's gathered positions
    visible: torch.Tensor | None  # bool [1, 1, q, len(seen)]; None: every position visible


@dataclass(frozen=True)
class _ChunkRow:
    """A prefill row's blocks from the first one its queries see (``first_position`` on)."""

    block_ids: torch.Tensor  # int64 [blocks]: the row's blocks from first_position's
    first_position: int  # context position of the first gathered slot (a block boundary)
    seq_len: int
    chunks: tuple[_QueryChunk, ...]


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention metadata, checked and turned into index tensors for every layer.

    Built by :func:`plan_attention_torch` from three metadata tensors; a call that passes the plan
    must pass those same tensor objects (and must not have changed them in place since). The plan
    also holds the decode groups' workspace, so one thread at a time may use it.

    The torch decode groups and prefill chunks are built on first use (:attr:`decode_groups`,
    :attr:`chunk_rows`): a plan whose rows run on the compiled kernel never pays for them.
    """

    block_tables: torch.Tensor  # int32 [num_rows, max_blocks_per_row], as planned
    query_start_loc: torch.Tensor  # int32 [num_rows + 1]
    seq_lens: torch.Tensor  # int32 [num_rows]
    num_tokens: int
    num_blocks: int
    block_size: int
    padding_tokens: torch.Tensor | None  # int64 [m]: tokens of padding rows; None: no padding
    decode_rows: torch.Tensor | None  # int64 [m]: rows with one query; None: there are none
    # int64 [m]: every row with queries, for the compiled kernel; None: not compiled, or no rows
    compiled_rows: torch.Tensor | None
    compiled: bool  # rows on the compiled kernel (float32 caches) instead of the torch paths
    # compiled only: prefill tokens in a decode row's order of sums (the batch-invariant mode)
    per_token: bool
    sliding_window: int | None  # every call with this plan attends with this window
    _decode_rows: tuple[int, ...]  # the same rows, for the torch groups
    _starts: tuple[int, ...]  # query_start_loc's values
    _lens: tuple[int, ...]  # seq_lens' values
    _tables: torch.Tensor  # int64 [num_rows, max_blocks_per_row]

    @cached_property
    def decode_groups(self) -> tuple[_DecodeGroup, ...]:
        """The decode rows in torch groups (bounded in memory and padding), made once."""
        if not self._decode_rows:
            return ()
        lens, starts = self._lens, self._starts
        # A decode row's query sits at position len - 1 and sees [first, len).
        firsts = [first_visible_position(n - 1, self.sliding_window) for n in lens]
        counts = tuple(n - first for n, first in zip(lens, firsts, strict=True))
        groups = []
        for rows in _decode_groups(list(self._decode_rows), counts):
            widths = [counts[r] for r in rows]
            slots = DecodeSlots.build(
                self._tables[rows],
                torch.tensor([firsts[r] for r in rows]),
                torch.tensor(widths),
                max(widths),
                block_size=self.block_size,
            )
            groups.append(_DecodeGroup(_token_index([starts[r] for r in rows]), slots))
        return tuple(groups)

    @cached_property
    def chunk_rows(self) -> tuple[_ChunkRow, ...]:
        """Rows with several queries, cut into query chunks with their masks, made once.

        Positions of a row's chunk (its first query at ``p0``, its last at ``p1``)::

            gathered   | first_position (block boundary) ............................ seq_len)
            chunk sees           | first_visible(p0) ................ p1 |
            query at p sees               | first_visible(p) ... p |       (the mask)
        """
        starts, lens, block_size = self._starts, self._lens, self.block_size
        window = self.sliding_window
        rows = []
        for r, seq_len in enumerate(lens):
            q_begin, q_end = starts[r], starts[r + 1]
            if seq_len == 0 or q_end - q_begin <= 1:
                continue
            # Token t of the row sits at context_begin + t - q_begin.
            context_begin = seq_len - (q_end - q_begin)
            first_block = first_visible_position(context_begin, window) // block_size
            gathered_from = first_block * block_size
            chunks = []
            for begin in range(q_begin, q_end, _MAX_QUERY_CHUNK):
                end = min(begin + _MAX_QUERY_CHUNK, q_end)
                positions = torch.arange(begin - q_begin, end - q_begin) + context_begin
                seen_from = first_visible_position(int(positions[0]), window)
                seen_to = context_begin + end - q_begin  # past the chunk's last query
                visible = None
                if end - begin > 1:
                    keys = torch.arange(seen_from, seen_to)[None, :]
                    visible = keys <= positions[:, None]
                    if window is not None:
                        visible &= keys > positions[:, None] - window
                    visible = visible[None, None]
                seen = slice(seen_from - gathered_from, seen_to - gathered_from)
                chunks.append(_QueryChunk(slice(begin, end), seen, visible))
            block_ids = self._tables[r, first_block : -(-seq_len // block_size)]
            rows.append(_ChunkRow(block_ids, gathered_from, seq_len, tuple(chunks)))
        return tuple(rows)

    def require_matches(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        sliding_window: int | None,
    ) -> None:
        """The plan was made for this call's metadata, window and cache geometry."""
        if (
            block_tables is not self.block_tables
            or query_start_loc is not self.query_start_loc
            or seq_lens is not self.seq_lens
        ):
            raise ValueError(
                "plan was made for other metadata tensors: pass the block_tables, "
                "query_start_loc and seq_lens it was planned from"
            )
        if sliding_window != self.sliding_window:
            raise ValueError(
                f"plan was made for sliding_window={self.sliding_window}, the call asks for "
                f"{sliding_window}: plan once per distinct window"
            )
        geometry = (query.shape[0], key_cache.shape[0], key_cache.shape[1])
        planned = (self.num_tokens, self.num_blocks, self.block_size)
        if geometry != planned:
            raise ValueError(
                f"plan was made for (num_tokens, num_blocks, block_size) = {planned}, "
                f"got {geometry}"
            )


def _token_index(tokens: list[int]) -> torch.Tensor | slice:
    """A slice when the tokens are consecutive and ascending (cheaper to read and write)."""
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        return slice(tokens[0], tokens[0] + len(tokens))
    return torch.tensor(tokens, dtype=torch.int64)


def _decode_groups(rows: list[int], lens: tuple[int, ...]) -> list[list[int]]:
    """Rows sorted by ``lens`` (positions each reads), cut into groups bounded in gathered
    memory and in padding.

    Rows arrive in their original order; sorting is skipped when one group holds them all.
    """
    ordered = sorted(rows, key=lambda r: lens[r])
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for r in ordered:
        # Sorted ascending: adding row r pads every row of the group to lens[r].
        padded = (len(group) + 1) * lens[r]
        too_big = padded > _MAX_GATHERED_POSITIONS
        too_sparse = padded > _MAX_PADDING_FACTOR * (total + lens[r])
        if group and (too_big or too_sparse):
            groups.append(group)
            group, total = [], 0
        group.append(r)
        total += lens[r]
    if group:
        groups.append(group)
    if len(groups) == 1:
        return [rows]
    return groups


def plan_attention_torch(
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    *,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    compiled: bool = False,
    per_token: bool = False,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Check the metadata's values once and precompute every layer's gather indices and masks.

    ``compiled``: every row on the compiled kernel (``kvgate.kernels.cpu``, which must be
    loaded) where the caches are float32; the torch groups and chunks are built only if a
    call's caches are not. ``per_token`` (compiled only): every prefill token is summed in the
    order of a decode row, so a token's output does not depend on the chunk it was computed
    in; calls whose caches the compiled kernel cannot read are refused instead of falling back.
    ``sliding_window``: the window of every call that uses the plan (the groups and masks depend
    on it; layers with another window need their own plan).
    """
    check_attention_options(sliding_window, None)
    if compiled and not cpu.loaded():
        raise ValueError("compiled attention asked for, but kvgate.kernels.cpu is not loaded")
    if per_token and not compiled:
        raise ValueError("per-token attention runs on the compiled kernel only")
    check_attention_metadata(
        block_tables,
        query_start_loc,
        seq_lens,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        sliding_window=sliding_window,
    )
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(torch.int64)
    q_lens = [starts[r + 1] - starts[r] for r in range(len(lens))]
    padding = [t for r, n in enumerate(lens) if n == 0 for t in range(starts[r], starts[r + 1])]
    decode_rows = [r for r, n in enumerate(lens) if n > 0 and q_lens[r] == 1]
    attended = [r for r, n in enumerate(lens) if n > 0 and q_lens[r] >= 1]
    return AttentionPlan(
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        padding_tokens=torch.tensor(padding, dtype=torch.int64) if padding else None,
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64) if decode_rows else None,
        compiled_rows=(
            torch.tensor(attended, dtype=torch.int64) if compiled and attended else None
        ),
        compiled=compiled,
        per_token=per_token,
        sliding_window=sliding_window,
        _decode_rows=tuple(decode_rows),
        _starts=tuple(starts),
        _lens=tuple(lens),
        _tables=tables,
    )


def _gather_row(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    row: _ChunkRow,
) -> torch.Tensor:  # [1, num_kv_heads, seq_len - first_position, head_dim] (a strided view)
    """One row's context from ``row.first_position`` on, copied block by block, float32."""
    num_kv_heads, head_dim = cache.shape[2:]
    blocks = cache.index_select(0, row.block_ids)
    if blocks.dtype != torch.float32:
        blocks = blocks.float()  # half-precision inputs: accumulate in float32
    positions = blocks.view(1, -1, num_kv_heads, head_dim)[:, : row.seq_len - row.first_position]
    return positions.transpose(1, 2)


def _softcapped_attention(
    q: torch.Tensor,  # [n, num_q_heads, q_len, head_dim]
    keys: torch.Tensor,  # [n, num_kv_heads, ctx, head_dim]
    values: torch.Tensor,  # [n, num_kv_heads, ctx, head_dim]
    visible: torch.Tensor | None,  # bool, broadcastable to [n, 1, q_len, ctx]
    softmax_scale: float,
    logit_softcap: float,
) -> torch.Tensor:  # [n, num_q_heads, q_len, head_dim]
    """SDPA's arithmetic with ``c * tanh(s / c)`` on every score ``s`` before the mask."""
    n, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    # Query head h reads KV head h // group: the group's heads become extra query rows.
    grouped = q.reshape(n, num_kv_heads, group * q_len, head_dim)
    scores = (grouped @ keys.transpose(-1, -2)) * softmax_scale  # [n, Hkv, group * q_len, ctx]
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores = scores.view(n, num_kv_heads, group, q_len, -1)
    if visible is not None:
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(n, num_kv_heads, group * q_len, -1)
    return (probs @ values).view(n, num_q_heads, q_len, head_dim)


def _gather_positions(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    slots: DecodeSlots,
) -> torch.Tensor:  # [n, num_kv_heads, max_len, head_dim] (a strided view), float32
    """Decode rows' contexts, position by position (caches :mod:`torch_decode` cannot read)."""
    return cache[slots.block_ids, slots.offsets].float().transpose(1, 2)


def _compiled_reads(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor
) -> bool:
    """The compiled kernel reads float32 with contiguous head vectors (any strides else)
    and K and V caches laid out alike, as the executor's are."""
    tensors = (query, key_cache, value_cache, out)
    same_layout = key_cache.stride() == value_cache.stride()
    return same_layout and all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (strided ok)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_rows, max_blocks_per_row]
    query_start_loc: torch.Tensor,  # int32 [num_rows + 1]
    seq_lens: torch.Tensor,  # int32 [num_rows]
    softmax_scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kvgate.kernels.paged_attention`, for CPU tensors."""
    check_attention_shapes(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, softmax_scale, out
    )
    check_attention_options(sliding_window, logit_softcap)
    if plan is None:
        plan = plan_attention_torch(
            block_tables,
            query_start_loc,
            seq_lens,
            num_tokens=query.shape[0],
            num_blocks=key_cache.shape[0],
            block_size=key_cache.shape[1],
            sliding_window=sliding_window,
        )
    else:
        plan.require_matches(
            query, key_cache, block_tables, query_start_loc, seq_lens, sliding_window
        )
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.padding_tokens is not None:
        out[plan.padding_tokens] = 0.0

    def attend(
        q: torch.Tensor,  # [n, num_q_heads, q_len, head_dim]
        keys: torch.Tensor,  # [n, num_kv_heads, ctx, head_dim]
        values: torch.Tensor,
        visible: torch.Tensor | None,  # bool, broadcastable to [n, 1, q_len, ctx]
    ) -> torch.Tensor:  # [n, num_q_heads, q_len, head_dim], the dtype of keys
        if logit_softcap is not None:
            return _softcapped_attention(
                q.to(keys.dtype), keys, values, visible, softmax_scale, logit_softcap
            )
        return F.scaled_dot_product_attention(
            q.to(keys.dtype),
            keys,
            values,
            attn_mask=visible,
            scale=softmax_scale,
            enable_gqa=True,
        )

    if plan.compiled and _compiled_reads(query, key_cache, value_cache, out):
        if plan.compiled_rows is not None:
            torch.ops.kvgate_cpu.paged_attention(
                query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                plan.compiled_rows, softmax_scale, out, plan.per_token, sliding_window,
                logit_softcap,
            )  # fmt: skip
        return out
    if plan.per_token:
        raise ValueError(
            "per-token attention needs float32 caches and query the compiled kernel can read"
        )
    decode_groups = plan.decode_groups
    if decode_groups:
        key_table, value_table = row_table(key_cache), row_table(value_cache)
        for group in decode_groups:
            q = query[group.tokens]  # [n, num_q_heads, head_dim]
            if key_table is not None and value_table is not None and key_table[1] == value_table[1]:
                result = decode_attention(
                    q.float(), key_table[0], value_table[0], key_table[1], key_cache.shape[2],
                    group.slots, softmax_scale, logit_softcap,
                )  # fmt: skip
            else:
                keys = _gather_positions(key_cache, group.slots)
                values = _gather_positions(value_cache, group.slots)
                hidden = group.slots.hidden
                visible = None if hidden is None else ~hidden[:, None]  # [n, 1, 1, max_len]
                result = attend(q[:, :, None], keys, values, visible)[:, :, 0]
            out[group.tokens] = result.to(out.dtype)

    for row in plan.chunk_rows:
        keys = _gather_row(key_cache, row)
        values = _gather_row(value_cache, row)
        for chunk in row.chunks:
            q = query[chunk.tokens].transpose(0, 1)[None]  # [1, num_q_heads, q, head_dim]
            seen = chunk.seen
            result = attend(q, keys[:, :, seen], values[:, :, seen], chunk.visible)
            out[chunk.tokens] = result[0].transpose(0, 1).to(out.dtype)
    return out
