"""Argument checks shared by every backend of every kernel.

Two kinds of check, kept apart on purpose:

* **Shape checks** read only tensor metadata (shapes, dtypes, strides, devices). They run on
  every call, on every backend, and never synchronise with a device.
* **Value checks** read tensor contents (block ids, lengths, slots). On CPU tensors they run on
  every call because they are cheap; on CUDA tensors they would stall the stream on every layer,
  so the launchers skip them and the caller runs :func:`check_attention_metadata` once per step
  (the metadata is shared by every layer of a step).

Every failure raises ``ValueError`` (or ``TypeError`` for a wrong dtype) whose message names the
argument and what was expected, before any tensor is written.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _require_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {_shape(t)}")


def _require_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {wanted}, got {str(t.dtype).removeprefix('torch.')}")


def _require_same_device(names_and_tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in names_and_tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def _require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}"
        )


def _require_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, rank: int) -> None:
    layout = (
        "[num_blocks, block_size, num_kv_heads, head_dim]"
        if rank == 4
        else "[num_blocks, num_layers, block_size, num_kv_heads, head_dim]"
    )
    _require_rank("key_cache", key_cache, rank, layout)
    _require_rank("value_cache", value_cache, rank, layout)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must have one shape, got {_shape(key_cache)} "
            f"and {_shape(value_cache)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(
            f"key_cache and value_cache must have one dtype, got {key_cache.dtype} "
            f"and {value_cache.dtype}"
        )
    _require_dtype("key_cache", key_cache, FLOAT_DTYPES)
    _require_last_dim_contiguous("key_cache", key_cache)
    _require_last_dim_contiguous("value_cache", value_cache)


def check_attention_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None,
) -> None:
    """Check everything about a ``paged_attention`` call that metadata alone can tell."""
    _require_rank("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    _require_dtype("query", query, FLOAT_DTYPES)
    _require_last_dim_contiguous("query", query)
    _require_cache_pair(key_cache, value_cache, rank=4)
    if key_cache.dtype != query.dtype:
        raise TypeError(
            f"key_cache/value_cache dtype {key_cache.dtype} must equal query dtype {query.dtype}"
        )
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = key_cache.shape[2], key_cache.shape[3]
    if cache_head_dim != head_dim:
        raise ValueError(
            f"query head_dim {head_dim} differs from the cache head_dim {cache_head_dim}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    _require_rank("block_tables", block_tables, 2, "[num_rows, max_blocks_per_row]")
    _require_dtype("block_tables", block_tables, (torch.int32,))
    _require_rank("query_start_loc", query_start_loc, 1, "[num_rows + 1]")
    _require_dtype("query_start_loc", query_start_loc, (torch.int32,))
    _require_rank("seq_lens", seq_lens, 1, "[num_rows]")
    _require_dtype("seq_lens", seq_lens, (torch.int32,))
    num_rows = seq_lens.shape[0]
    if block_tables.shape[0] != num_rows:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but seq_lens has {num_rows}"
        )
    if query_start_loc.shape[0] != num_rows + 1:
        raise ValueError(
            f"query_start_loc must hold num_rows + 1 = {num_rows + 1} offsets, "
            f"got {query_start_loc.shape[0]}"
        )
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables rows must be contiguous, got strides {block_tables.stride()}"
        )
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    tensors = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
    }
    if out is not None:
        if out.shape != query.shape:
            raise ValueError(f"out must have the query shape {_shape(query)}, got {_shape(out)}")
        if out.dtype != query.dtype:
            raise TypeError(f"out dtype {out.dtype} must equal query dtype {query.dtype}")
        _require_last_dim_contiguous("out", out)
        tensors["out"] = out
    _require_same_device(tensors)


def check_attention_options(sliding_window: int | None, logit_softcap: float | None) -> None:
    """The two optional masks of ``paged_attention``: a window of >= 1 positions, a cap > 0.

    Both are model constants (a config's ``sliding_window`` and ``attn_logit_softcapping``),
    so a wrong type or value is a caller's bug: refused by name rather than coerced.
    """
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise TypeError(
                f"sliding_window must be an int (positions) or None, "
                f"got {type(sliding_window).__name__}"
            )
        if sliding_window < 1:
            raise ValueError(
                f"sliding_window must be >= 1 (a query always sees itself), got {sliding_window}"
            )
    if logit_softcap is not None:
        if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, int | float):
            raise TypeError(
                f"logit_softcap must be a float or None, got {type(logit_softcap).__name__}"
            )
        if not (math.isfinite(logit_softcap) and logit_softcap > 0):
            raise ValueError(f"logit_softcap must be finite and > 0, got {logit_softcap}")


def first_visible_position(position: int, sliding_window: int | None) -> int:
    """The first context position a query at ``position`` sees: ``p - W < k <= p``."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def check_attention_metadata(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    *,
    sliding_window: int | None = None,
) -> None:
    """Check the values of a step's attention metadata (reads the tensors: syncs on CUDA).

    Rules (row ``r``, ``q_len = query_start_loc[r+1] - query_start_loc[r]``)::

        query_start_loc[0] == 0, non-decreasing, query_start_loc[-1] == num_tokens
        seq_len == 0                      -> a padding row: its q_len tokens get zeros
        seq_len > 0                       -> 0 <= q_len <= seq_len (queries are the context's tail)
        seq_len <= max_blocks_per_row * block_size
        block_tables[r, first:ceil(seq_len / block_size)] in [0, num_blocks)

    where ``first`` is 0, or with ``sliding_window = W`` the block of the first position the
    row's first query sees (``max(0, seq_len - q_len - W + 1) // block_size``): entries before
    it and past the context are never read, so they may name freed blocks or anything else.
    """
    qsl = query_start_loc.detach().to("cpu", torch.int64)
    lens = seq_lens.detach().to("cpu", torch.int64)
    if qsl.numel() == 0 or int(qsl[0]) != 0:
        raise ValueError("query_start_loc[0] must be 0")
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        row = int(torch.nonzero(q_lens < 0)[0])
        raise ValueError(f"query_start_loc must be non-decreasing; it decreases at row {row}")
    if int(qsl[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc[-1] ({int(qsl[-1])}) must equal num_tokens ({num_tokens}); "
            "give padding tokens a row with seq_len 0"
        )
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    too_many_queries = (lens > 0) & (q_lens > lens)
    if bool(too_many_queries.any()):
        row = int(torch.nonzero(too_many_queries)[0])
        raise ValueError(
            f"row {row} has {int(q_lens[row])} query tokens but seq_len {int(lens[row])}; "
            "seq_len counts the row's new tokens too"
        )
    max_blocks_per_row = block_tables.shape[1]
    capacity = max_blocks_per_row * block_size
    if bool((lens > capacity).any()):
        row = int(torch.nonzero(lens > capacity)[0])
        raise ValueError(
            f"row {row} has seq_len {int(lens[row])} but its block table holds only "
            f"{max_blocks_per_row} blocks of {block_size} = {capacity} positions"
        )
    if max_blocks_per_row == 0:
        return
    tables = block_tables.detach().to("cpu", torch.int64)
    blocks_used = (lens + block_size - 1) // block_size
    columns = torch.arange(max_blocks_per_row)[None, :]
    used = columns < blocks_used[:, None]
    if sliding_window is not None:
        first_needed = (lens - q_lens - sliding_window + 1).clamp(min=0) // block_size
        used &= columns >= first_needed[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_tables[{row}, {col}] = {int(tables[row, col])} is outside the cache's "
            f"{num_blocks} blocks"
        )


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Shape checks for ``write_kv``; value checks too when the slots are on the CPU (unless
    ``check_values`` is False: the caller checked them with :func:`check_slot_mapping`)."""
    _require_cache_pair(key_cache, value_cache, rank=4)
    for name, t in (("key", key), ("value", value)):
        _require_rank(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        _require_last_dim_contiguous(name, t)
        if t.dtype != key_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must equal the cache dtype {key_cache.dtype}")
        if t.shape[1:] != key_cache.shape[2:]:
            raise ValueError(
                f"{name} [num_tokens, num_kv_heads, head_dim] = {_shape(t)} does not fit the "
                f"cache's [.., num_kv_heads, head_dim] = {_shape(key_cache)}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key and value must have one shape, got {_shape(key)}, {_shape(value)}")
    _require_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _require_dtype("slot_mapping", slot_mapping, (torch.int64,))
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    _require_same_device(
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
        }
    )
    if check_values and slot_mapping.device.type == "cpu":
        check_slot_mapping(slot_mapping, num_slots=key_cache.shape[0] * key_cache.shape[1])


def check_slot_mapping(slot_mapping: torch.Tensor, *, num_slots: int) -> None:
    """``write_kv``'s value checks: slots below ``num_slots``, distinct; negative = padding."""
    _check_slots("slot_mapping", slot_mapping, num_slots, allow_negative=True)


def _check_slots(name: str, slots: torch.Tensor, num_slots: int, allow_negative: bool) -> None:
    """Slots in range and pairwise distinct (parallel writes to one slot have no defined order)."""
    kept = slots[slots >= 0] if allow_negative else slots
    if not allow_negative and bool((slots < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {slots[slots < 0][:8].tolist()}")
    if bool((kept >= num_slots).any()):
        raise ValueError(f"{name} holds slot {int(kept.max())} but the cache has {num_slots} slots")
    if kept.numel() != torch.unique(kept).numel():
        raise ValueError(f"{name} must not name one slot twice")


def check_copy_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Shape checks for ``copy_slots``; value checks too when the slots are on the CPU."""
    _require_cache_pair(key_cache, value_cache, rank=5)
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        _require_rank(name, t, 1, "[n]")
        _require_dtype(name, t, (torch.int64,))
    if src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots and dst_slots must pair up, got {src_slots.shape[0]} "
            f"and {dst_slots.shape[0]} slots"
        )
    _require_same_device(
        {
            "key_cache": key_cache,
            "value_cache": value_cache,
            "src_slots": src_slots,
            "dst_slots": dst_slots,
        }
    )
    if src_slots.device.type == "cpu":
        num_slots = key_cache.shape[0] * key_cache.shape[2]
        _check_slots("dst_slots", dst_slots, num_slots, allow_negative=False)
        if bool((src_slots < 0).any()) or bool((src_slots >= num_slots).any()):
            raise ValueError(f"src_slots must lie in [0, {num_slots})")
        # A slot both read and written would make the result depend on program order.
        if bool(torch.isin(src_slots, dst_slots).any()):
            raise ValueError("a slot may not be both a source and a destination")


def check_block_ids(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Checks for ``gather_blocks``/``scatter_blocks``: ids in range and distinct."""
    _require_cache_pair(key_cache, value_cache, rank=5)
    _require_rank("block_ids", block_ids, 1, "[n]")
    _require_dtype("block_ids", block_ids, (torch.int64,))
    ids = block_ids.detach().to("cpu")
    num_blocks = key_cache.shape[0]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"block_ids must lie in [0, {num_blocks}), got {ids.tolist()[:16]}")
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError("block_ids must not name one block twice")


def check_host_blocks(
    key_cache: torch.Tensor, host_keys: torch.Tensor, host_values: torch.Tensor, num_ids: int
) -> None:
    """The host buffers of ``scatter_blocks`` must be what ``gather_blocks`` returned."""
    expected = (num_ids, *key_cache.shape[1:])
    for name, t in (("host_keys", host_keys), ("host_values", host_values)):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} must be [n, num_layers, block_size, num_kv_heads, head_dim] = "
                f"{list(expected)}, got {_shape(t)}"
            )
        if t.dtype != key_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must equal the cache dtype {key_cache.dtype}")
