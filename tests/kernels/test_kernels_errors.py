"""Bad input: a clear error naming the problem, raised before anything is written.

Every case runs through the public functions on both CPU backends (the interpreted Triton
launchers and the torch path share the checks in ``checks.py`` but call them separately), and
afterwards the output and caches are compared with their state before the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvgate import kernels
from kvgate.kernels import triton_attention
from tests.kernels.paged_cases import PagedBatch, Row, build_batch


@pytest.fixture(params=["triton-interpreted", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(
        "interpreted_triton" if request.param == "triton-interpreted" else "torch_backend"
    )
    return str(request.param)


def small_batch() -> PagedBatch:
    return build_batch(
        [Row(1, 9), Row(3, 5)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4
    )


def _table(batch: PagedBatch, row: int, col: int, value: int) -> torch.Tensor:
    tables = batch.block_tables.clone()
    tables[row, col] = value
    return tables


# (id, change to the batch, exception type, message pattern)
ATTENTION_CASES: list[tuple[str, Callable[[PagedBatch], dict[str, Any]], type, str]] = [
    ("query-2d", lambda b: {"query": b.query[:, 0]}, ValueError, "query must be 3-D"),
    ("query-int", lambda b: {"query": b.query.to(torch.int32)}, TypeError, "query must be"),
    ("cache-dtype", lambda b: {"query": b.query.half()}, TypeError, "must equal query dtype"),
    ("heads-not-multiple", lambda b: {"query": b.query[:, :3]}, ValueError, "multiple of"),
    ("head-dim", lambda b: {"query": b.query[..., :32]}, ValueError, "head_dim 32 differs"),
    (
        "tables-int64",
        lambda b: {"block_tables": b.block_tables.long()},
        TypeError,
        "block_tables must be int32",
    ),
    (
        "qsl-length",
        lambda b: {"query_start_loc": b.query_start_loc[:2]},
        ValueError,
        "num_rows \\+ 1 = 3 offsets",
    ),
    (
        "seq-lens-length",
        lambda b: {"seq_lens": b.seq_lens[:1]},
        ValueError,
        "block_tables has 2 rows",
    ),
    (
        "query-last-dim-strided",
        lambda b: {"query": b.query.transpose(1, 2).contiguous().transpose(1, 2)},
        ValueError,
        "contiguous last",
    ),
    (
        "qsl-not-from-zero",
        lambda b: {"query_start_loc": b.query_start_loc + 1},
        ValueError,
        "query_start_loc\\[0\\] must be 0",
    ),
    (
        "qsl-decreasing",
        lambda b: {"query_start_loc": torch.tensor([0, 3, 1], dtype=torch.int32)},
        ValueError,
        "non-decreasing",
    ),
    (
        "qsl-short-of-tokens",
        lambda b: {"query_start_loc": torch.tensor([0, 1, 3], dtype=torch.int32)},
        ValueError,
        "must equal num_tokens",
    ),
    (
        "negative-seq-len",
        lambda b: {"seq_lens": torch.tensor([-1, 5], dtype=torch.int32)},
        ValueError,
        "seq_lens must be >= 0",
    ),
    (
        "more-queries-than-context",
        lambda b: {"seq_lens": torch.tensor([9, 2], dtype=torch.int32)},
        ValueError,
        "row 1 has 3 query tokens but seq_len 2",
    ),
    (
        "context-beyond-table",
        lambda b: {"seq_lens": torch.tensor([9, 40], dtype=torch.int32)},
        ValueError,
        "block table holds only",
    ),
    (
        "block-id-too-large",
        lambda b: {"block_tables": _table(b, 0, 2, 10_000)},
        ValueError,
        "block_tables\\[0, 2\\] = 10000 is outside",
    ),
    (
        "block-id-negative",
        lambda b: {"block_tables": _table(b, 1, 1, -1)},
        ValueError,
        "block_tables\\[1, 1\\] = -1",
    ),
    ("device-mix", lambda b: {"seq_lens": b.seq_lens.to("meta")}, ValueError, "one device"),
]


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [case[1:] for case in ATTENTION_CASES],
    ids=[case[0] for case in ATTENTION_CASES],
)
def test_paged_attention_rejects(
    backend: str, change: Callable[[PagedBatch], dict[str, Any]], error: type, pattern: str
) -> None:
    base = small_batch()
    batch = replace(base, **change(base))
    out = torch.full(base.query.shape, 7.0)
    caches = (base.key_cache_5d.clone(), base.value_cache_5d.clone())
    with pytest.raises(error, match=pattern):
        kernels.paged_attention(*batch.args(), batch.softmax_scale, out=out)
    assert torch.equal(out, torch.full_like(out, 7.0))
    torch.testing.assert_close(base.key_cache_5d, caches[0], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("out", "pattern"),
    [
        (torch.zeros(4, 4, 32), "out must have the query shape"),
        (torch.zeros(4, 4, 64, dtype=torch.float16), "out dtype"),
    ],
    ids=["shape", "dtype"],
)
def test_paged_attention_rejects_bad_out(backend: str, out: torch.Tensor, pattern: str) -> None:
    batch = small_batch()
    with pytest.raises((ValueError, TypeError), match=pattern):
        kernels.paged_attention(*batch.args(), batch.softmax_scale, out=out)


def test_paged_attention_rejects_nan_scale(backend: str) -> None:
    batch = small_batch()
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        kernels.paged_attention(*batch.args(), float("nan"))


# (id, keyword arguments, exception type, message pattern)
OPTION_CASES: list[tuple[str, dict[str, Any], type, str]] = [
    ("window-zero", {"sliding_window": 0}, ValueError, "sliding_window must be >= 1"),
    (
        "window-negative",
        {"sliding_window": -4},
        ValueError,
        "sliding_window must be >= 1 .*, got -4",
    ),
    ("window-float", {"sliding_window": 8.0}, TypeError, "sliding_window must be an int"),
    ("window-bool", {"sliding_window": True}, TypeError, "sliding_window must be an int"),
    ("softcap-zero", {"logit_softcap": 0.0}, ValueError, "logit_softcap must be finite and > 0"),
    ("softcap-negative", {"logit_softcap": -50.0}, ValueError, "finite and > 0, got -50.0"),
    ("softcap-nan", {"logit_softcap": float("nan")}, ValueError, "finite and > 0, got nan"),
    ("softcap-inf", {"logit_softcap": float("inf")}, ValueError, "finite and > 0, got inf"),
    ("softcap-string", {"logit_softcap": "50"}, TypeError, "logit_softcap must be a float"),
]


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [case[1:] for case in OPTION_CASES],
    ids=[case[0] for case in OPTION_CASES],
)
def test_paged_attention_rejects_options(
    backend: str, options: dict[str, Any], error: type, pattern: str
) -> None:
    batch = small_batch()
    out = torch.full(batch.query.shape, 7.0)
    with pytest.raises(error, match=pattern):
        kernels.paged_attention(*batch.args(), batch.softmax_scale, out=out, **options)
    assert torch.equal(out, torch.full_like(out, 7.0))
    if "sliding_window" in options:  # a plan is made for one window: checked there too
        with pytest.raises(error, match=pattern):
            kernels.plan_attention(
                batch.block_tables, batch.query_start_loc, batch.seq_lens, num_tokens=4,
                num_blocks=batch.key_cache.shape[0], block_size=4, **options,
            )  # fmt: skip


def test_block_ids_inside_the_window_are_still_checked(backend: str) -> None:
    """Entries before a row's window are never read (any value passes); the rest are checked."""
    batch = build_batch([Row(1, 20)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    before_window = replace(batch, block_tables=_table(batch, 0, 2, -5))  # positions 8..11
    out = kernels.paged_attention(*before_window.args(), 1.0, sliding_window=8)
    assert not out.isnan().any()
    inside_window = replace(batch, block_tables=_table(batch, 0, 3, -5))  # positions 12..15
    with pytest.raises(ValueError, match="block_tables\\[0, 3\\] = -5 is outside"):
        kernels.paged_attention(*inside_window.args(), 1.0, sliding_window=8)
    with pytest.raises(ValueError, match="block_tables\\[0, 2\\] = -5 is outside"):
        kernels.paged_attention(*before_window.args(), 1.0)  # full causal reads it


def test_triton_rejects_oversized_head_dim(interpreted_triton: None) -> None:
    batch = build_batch([Row(1, 2)], num_q_heads=1, num_kv_heads=1, head_dim=320, block_size=4)
    with pytest.raises(ValueError, match="head_dim 320 exceeds"):
        kernels.paged_attention(*batch.args(), batch.softmax_scale)


def test_interpreter_refuses_bf16_attention(interpreted_triton: None) -> None:
    """Its bf16 dot products are wrong by orders of magnitude: an error beats a wrong answer."""
    batch = build_batch(
        [Row(1, 5)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=4, dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="interpreter computes bfloat16 attention wrongly"):
        kernels.paged_attention(*batch.args(), batch.softmax_scale)


def test_triton_rejects_bad_config(interpreted_triton: None) -> None:
    batch = small_batch()
    config = triton_attention.AttentionConfig(24, 16, 1, 4, 1)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        triton_attention.paged_attention_triton(*batch.args(), 1.0, config=config)
    config = triton_attention.AttentionConfig(16, 16, 1, 4, 1)
    wide = build_batch([Row(1, 2)], num_q_heads=32, num_kv_heads=1, head_dim=64, block_size=4)
    with pytest.raises(ValueError, match="must hold one token's 32 query heads"):
        triton_attention.paged_attention_triton(*wide.args(), 1.0, config=config)


def _kv_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key = torch.randn(3, 2, 64)
    cache = torch.randn(4, 1, 4, 2, 64)
    return key, -key, cache, cache.clone() + 1


WRITE_CASES: list[tuple[str, dict[str, Any], type, str]] = [
    (
        "slot-too-large",
        {"slot_mapping": torch.tensor([0, 16, 1])},
        ValueError,
        "holds slot 16 but the cache has 16 slots",
    ),
    ("duplicate-slot", {"slot_mapping": torch.tensor([3, 3, 1])}, ValueError, "one slot twice"),
    (
        "int32-slots",
        {"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)},
        TypeError,
        "slot_mapping must be int64",
    ),
    ("slot-count", {"slot_mapping": torch.tensor([0, 1])}, ValueError, "2 slots for 3 tokens"),
    ("key-dtype", {"key": torch.randn(3, 2, 64).half()}, TypeError, "key dtype"),
    ("key-heads", {"key": torch.randn(3, 1, 64)}, ValueError, "does not fit"),
    ("value-shape", {"value": torch.randn(2, 2, 64)}, ValueError, "one shape"),
]


@pytest.mark.parametrize(
    ("override", "error", "pattern"),
    [case[1:] for case in WRITE_CASES],
    ids=[case[0] for case in WRITE_CASES],
)
def test_write_kv_rejects(
    backend: str, override: dict[str, Any], error: type, pattern: str
) -> None:
    key, value, key_cache, value_cache = _kv_inputs()
    args = {"key": key, "value": value, "slot_mapping": torch.tensor([0, 5, -1])} | override
    before = (key_cache.clone(), value_cache.clone())
    with pytest.raises(error, match=pattern):
        kernels.write_kv(
            args["key"], args["value"], key_cache[:, 0], value_cache[:, 0], args["slot_mapping"]
        )
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


COPY_CASES: list[tuple[str, torch.Tensor, torch.Tensor, str]] = [
    ("dst-twice", torch.tensor([0, 1]), torch.tensor([5, 5]), "dst_slots must not name one slot"),
    ("src-is-dst", torch.tensor([0, 5]), torch.tensor([5, 6]), "both a source and a destination"),
    ("dst-out-of-range", torch.tensor([0, 1]), torch.tensor([5, 16]), "holds slot 16"),
    ("src-negative", torch.tensor([-1, 1]), torch.tensor([5, 6]), "src_slots must lie in"),
    ("dst-negative", torch.tensor([0, 1]), torch.tensor([5, -6]), "dst_slots must be >= 0"),
    ("unpaired", torch.tensor([0, 1]), torch.tensor([5]), "must pair up"),
]


@pytest.mark.parametrize(
    ("src", "dst", "pattern"),
    [case[1:] for case in COPY_CASES],
    ids=[case[0] for case in COPY_CASES],
)
def test_copy_slots_rejects(
    backend: str, src: torch.Tensor, dst: torch.Tensor, pattern: str
) -> None:
    _, _, key_cache, value_cache = _kv_inputs()
    before = key_cache.clone()
    with pytest.raises(ValueError, match=pattern):
        kernels.copy_slots(key_cache, value_cache, src, dst)
    assert torch.equal(key_cache, before)


def test_copy_slots_rejects_layer_view(backend: str) -> None:
    _, _, key_cache, value_cache = _kv_inputs()
    with pytest.raises(ValueError, match="key_cache must be 5-D"):
        kernels.copy_slots(key_cache[:, 0], value_cache[:, 0], torch.tensor([0]), torch.tensor([1]))


def test_block_swap_rejects() -> None:
    _, _, key_cache, value_cache = _kv_inputs()
    with pytest.raises(ValueError, match="block_ids must lie in \\[0, 4\\)"):
        kernels.gather_blocks(key_cache, value_cache, torch.tensor([4]))
    with pytest.raises(ValueError, match="one block twice"):
        kernels.gather_blocks(key_cache, value_cache, torch.tensor([1, 1]))
    host_k, host_v = kernels.gather_blocks(key_cache, value_cache, torch.tensor([1, 2]))
    before = key_cache.clone()
    with pytest.raises(ValueError, match="host_keys must be"):
        kernels.scatter_blocks(key_cache, value_cache, torch.tensor([0]), host_k, host_v)
    with pytest.raises(TypeError, match="host_values dtype"):
        kernels.scatter_blocks(key_cache, value_cache, torch.tensor([0, 3]), host_k, host_v.half())
    assert torch.equal(key_cache, before)
