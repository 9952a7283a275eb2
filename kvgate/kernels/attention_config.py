"""Launch configuration of the paged attention kernel: the heuristics and the constexprs.

Pure Python (no Triton import), shared by the launcher, the benchmark's sweep and the compile
check (``python -m kvgate.kernels.compile_check``), so all three build the same kernel variants.

No autotuning: Triton's interpreter cannot run it, CI must be deterministic, and a serving step
should never pay a tuning pass. ``benchmarks/bench_kernels.py --sweep`` measures alternatives so
these tables can be revised from numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch

MAX_HEAD_DIM = 256
MAX_SPLITS = 16


@dataclass(frozen=True)
class AttentionConfig:
    """How one launch tiles the work (``block_m`` and ``tile_n`` are powers of two >= 16)."""

    block_m: int  # score-matrix rows per program: query tokens x the GQA heads of one KV head
    tile_n: int  # KV positions per inner iteration
    num_splits: int  # context splits per (query tile, KV head); 1 writes the output directly
    num_warps: int
    num_stages: int


class AttentionConstants(TypedDict):
    """The ``tl.constexpr`` arguments of ``_paged_attention_kernel``."""

    HEAD_DIM: int
    HEAD_DIM_PAD: int
    BLOCK_SIZE: int
    QUERIES_PER_KV: int
    BLOCK_M: int
    BLOCK_Q: int
    TILE_N: int
    NUM_SPLITS: int
    DOT_PRECISION: str
    # Constants of a model (one compiled variant per distinct value; a model has one or two):
    SLIDING_WINDOW: int | None  # positions a query sees, itself included; None: full causal
    LOGIT_SOFTCAP: float | None  # scores s become c * tanh(s / c); None: no cap


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def choose_config(
    *,
    num_tokens: int,
    num_rows: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    sm_count: int | None,
) -> AttentionConfig:
    """Pick tiles for a batch; ``sm_count`` None means the CPU interpreter.

    Decode-like batches (at most one query per row on average) are bandwidth-bound: small query
    tiles, long KV tiles and many resident programs. Prefill is compute-bound: large query tiles
    so every K/V tile loaded is used by more queries. When the grid would not fill the GPU
    (small decode batches, one prefill chunk with few heads) each row's context is split and the
    partial results merged (flash-decoding).
    """
    group_rows = next_power_of_2(queries_per_kv)
    if sm_count is None:  # interpreter: small tiles so that tiny tests cross many tile edges
        return AttentionConfig(max(16, group_rows), 16, 1, num_warps=4, num_stages=1)
    head_dim_pad = next_power_of_2(head_dim)
    decode_like = num_tokens <= num_rows
    if dtype == torch.float32:
        # IEEE fp32 products run on CUDA cores, not tensor cores: small tiles, more warps.
        block_m, tile_n, num_warps, num_stages, waves = 16, 32, 8, 2, 4
    elif decode_like:
        block_m, tile_n = 16, 64 if head_dim_pad <= 128 else 32
        num_warps, num_stages, waves = 4, 2, 4
    else:
        block_m, tile_n = (128, 64) if head_dim_pad <= 128 else (64, 32)
        num_warps, num_stages, waves = (8 if block_m == 128 else 4), 3, 2
    block_m = max(block_m, group_rows)
    block_q = block_m // queries_per_kv
    programs = (num_tokens // block_q + num_rows) * num_kv_heads
    target = waves * sm_count
    num_splits = 1 if programs >= target else min(MAX_SPLITS, math.ceil(target / programs))
    return AttentionConfig(block_m, tile_n, num_splits, num_warps, num_stages)


def check_config(config: AttentionConfig, queries_per_kv: int) -> None:
    """Reject configs the kernel cannot run (a caller-supplied config is input too)."""
    for name in ("block_m", "tile_n"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {value}")
    if config.block_m < queries_per_kv:
        raise ValueError(
            f"config.block_m ({config.block_m}) must hold one token's {queries_per_kv} query heads"
        )
    if not 1 <= config.num_splits <= MAX_SPLITS:
        raise ValueError(f"config.num_splits must be in [1, {MAX_SPLITS}], got {config.num_splits}")


def attention_constants(
    *,
    config: AttentionConfig,
    head_dim: int,
    block_size: int,
    queries_per_kv: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> AttentionConstants:
    return AttentionConstants(
        HEAD_DIM=head_dim,
        # tl.arange needs a power of two and tl.dot needs >= 16: pad and mask the rest.
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=config.block_m,
        BLOCK_Q=config.block_m // queries_per_kv,
        TILE_N=config.tile_n,
        NUM_SPLITS=config.num_splits,
        # fp32 inputs must not be rounded to tf32 on tensor cores; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SLIDING_WINDOW=sliding_window,
        LOGIT_SOFTCAP=None if logit_softcap is None else float(logit_softcap),
    )
