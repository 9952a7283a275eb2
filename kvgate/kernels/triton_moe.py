# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (@triton.jit kernels cannot carry Python annotations: Triton reads them as kernel types.)
"""Triton fused experts for mixture-of-experts layers: a grouped GEMM over tokens sorted by expert.

The specification is :func:`kvgate.kernels.torch_moe.fused_experts_reference`; this computes
the same ``out [n, H]`` in three steps::

    plan (torch, on the device, no host sync)    pairs p = t * k + j sorted by expert, each
                                                 expert's run padded to a multiple of BLOCK_M:
        pair_ids      [ e0 e0 e0 pad | e2 e2 pad pad | e3 ... ]   (pad = num_pairs: no pair)
        block_experts [ 0            | 2             | 3   ... ]   (num_experts: no work)

    _expert_gate_up_kernel   grid (blocks, I / BLOCK_N): one block of BLOCK_M pairs of one
                             expert x BLOCK_N intermediate columns; the gate and up tiles are
                             two accumulators over H, then act = silu(gate) * up, stored per pair
    _expert_down_kernel      grid (blocks, H / BLOCK_N): act @ down[e].T over I, scaled by the
                             pair's routing weight, stored per pair (float32)
    sum over the k slots     (torch) out[t] = sum_j pair_out[t * k + j]

Every pair's result is written to its own row and the slots are summed afterwards, so the
output is deterministic (no atomics). Experts no token chose get no block at all. The grid is
sized on the host from ``n * k`` and ``E`` alone (``ceil(n k / BLOCK_M) + min(E, n k)`` blocks
bound every routing); blocks past the last expert's run exit at once.

Accumulation is float32; the activation is rounded to the input dtype between the two GEMMs (as
transformers' experts round it), the routing weight is applied in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvgate.kernels.torch_moe import check_experts_args
from kvgate.kernels.triton_common import require_matching_triton_mode

__all__ = ["ExpertBlocks", "ExpertsConfig", "fused_experts_triton", "plan_expert_blocks"]


@dataclass(frozen=True)
class ExpertsConfig:
    """How one launch tiles the work (every block size a power of two >= 16: ``tl.dot``)."""

    block_m: int  # pairs per program, all of one expert
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int

    def check(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"config.{name} must be a power of two >= 16, got {value}")


def choose_experts_config(
    num_pairs: int, num_experts: int, dtype: torch.dtype, *, interpreted: bool
) -> ExpertsConfig:
    """Tiles from the mean pairs per expert (no autotuning: see ``attention_config``).

    Decode batches give each expert a handful of pairs: a 16-row block wastes least padding and
    the kernel is bound by reading the experts' weights. Prefill chunks fill larger blocks, so
    each weight tile loaded serves more pairs.
    """
    if interpreted:  # small tiles so that tiny tests cross many tile edges
        return ExpertsConfig(16, 16, 16, num_warps=4, num_stages=1)
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    if dtype == torch.float32:
        # IEEE fp32 products run on CUDA cores, not tensor cores: smaller tiles.
        return ExpertsConfig(min(block_m, 32), 32, 16, num_warps=4, num_stages=2)
    return ExpertsConfig(block_m, 64, 64, num_warps=4, num_stages=3)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be rounded to tf32 on tensor cores; 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert in runs of ``block_m`` (module docstring's diagram)."""

    pair_ids: torch.Tensor  # int32 [num_blocks * block_m]; num_pairs marks padding
    block_experts: torch.Tensor  # int32 [num_blocks]; num_experts marks a block with no work
    block_m: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_experts.shape[0])


def plan_expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the pairs of ``topk_ids [n, k]`` by expert (stable: by pair id within an expert).

    Only tensor operations whose output sizes are known on the host: no device synchronisation.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    run_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_run = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    # Σ_e ceil(c_e / m) <= Σ_{c_e > 0} (c_e / m + 1) <= ceil(n k / m) + min(E, n k)
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[padded_start[sorted_experts] + rank_in_run] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return ExpertBlocks(pair_ids, block_experts, block_m)


@triton.jit
def _expert_gate_up_kernel(
    x_ptr,  # [n, H]
    gate_up_ptr,  # [E, 2 I, H]: gate rows [0, I), up rows [I, 2 I)
    act_ptr,  # [n * k, I]: silu(gate) * up of every pair, x's dtype
    pair_ids_ptr,  # int32 [num_blocks * BLOCK_M]
    block_experts_ptr,  # int32 [num_blocks]
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_x_token,
    stride_gu_expert,
    stride_gu_row,
    stride_act_pair,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:  # past the last expert's run
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    is_pair = pairs < num_pairs
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < inter
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_x_token + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] tiles of gate[e].T and up[e].T
    gate_ptrs = gate_up_ptr + expert * stride_gu_expert + cols[None, :] * stride_gu_row
    gate_ptrs += ks[:, None]
    up_ptrs = gate_ptrs + inter * stride_gu_row
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        in_k = k0 + ks < hidden
        x = tl.load(x_ptrs, mask=is_pair[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & in_cols[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    act_ptrs = act_ptr + pairs[:, None] * stride_act_pair + cols[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=is_pair[:, None] & in_cols[None, :])


@triton.jit
def _expert_down_kernel(
    act_ptr,  # [n * k, I]
    down_ptr,  # [E, H, I]
    pair_out_ptr,  # float32 [n * k, H]: each pair's weighted expert output
    topk_weights_ptr,  # float32 [n * k]
    pair_ids_ptr,  # int32 [num_blocks * BLOCK_M]
    block_experts_ptr,  # int32 [num_blocks]
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_act_pair,
    stride_down_expert,
    stride_down_row,
    stride_out_pair,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    is_pair = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < hidden
    ks = tl.arange(0, BLOCK_K)

    act_ptrs = act_ptr + pairs[:, None] * stride_act_pair + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] tile of down[e].T
    down_ptrs = down_ptr + expert * stride_down_expert + cols[None, :] * stride_down_row
    down_ptrs += ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        in_k = k0 + ks < inter
        act = tl.load(act_ptrs, mask=is_pair[:, None] & in_k[None, :], other=0.0)
        down = tl.load(down_ptrs, mask=in_k[:, None] & in_cols[None, :], other=0.0)
        acc = tl.dot(act, down, acc, input_precision=DOT_PRECISION)
        act_ptrs += BLOCK_K
        down_ptrs += BLOCK_K
    weights = tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)
    acc = acc * weights[:, None]
    out_ptrs = pair_out_ptr + pairs[:, None] * stride_out_pair + cols[None, :]
    tl.store(out_ptrs, acc, mask=is_pair[:, None] & in_cols[None, :])


def fused_experts_triton(
    x: torch.Tensor,  # [n, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float32 [n, k]
    topk_ids: torch.Tensor,  # int32/int64 [n, k]
    config: ExpertsConfig | None = None,
) -> torch.Tensor:  # [n, H], x's dtype
    """Launch the two kernels over the planned blocks; sum each token's slots."""
    check_experts_args(x, gate_up, down, topk_weights, topk_ids)
    for name, tensor in (("x", x), ("gate_up", gate_up), ("down", down)):
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got {tensor.stride()}")
    require_matching_triton_mode(_expert_gate_up_kernel, x.device)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden)
    if config is None:
        config = choose_experts_config(
            num_pairs, num_experts, x.dtype, interpreted=x.device.type == "cpu"
        )
    config.check()
    blocks = plan_expert_blocks(topk_ids, num_experts, config.block_m)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    shared = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "DOT_PRECISION": dot_precision(x.dtype),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    _expert_gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, config.block_n))](
        x,
        gate_up,
        act,
        blocks.pair_ids,
        blocks.block_experts,
        num_pairs,
        num_experts,
        hidden,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        act.stride(0),
        TOP_K=top_k,
        **shared,
    )
    _expert_down_kernel[(blocks.num_blocks, triton.cdiv(hidden, config.block_n))](
        act,
        down,
        pair_out,
        topk_weights.reshape(-1).contiguous(),
        blocks.pair_ids,
        blocks.block_experts,
        num_pairs,
        num_experts,
        hidden,
        inter,
        act.stride(0),
        down.stride(0),
        down.stride(1),
        pair_out.stride(0),
        **shared,
    )
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
