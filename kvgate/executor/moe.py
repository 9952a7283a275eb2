"""The mixture-of-experts MLP block: router, top-k, the experts, a gated shared expert.

``MoeBlock(x [n, H]) -> [n, H]``, the call of every MLP block, computes (transformers 5.24's
Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks)::

    p        = softmax(router(x))                      float32, over all E experts
    w, ids   = top_k(p)                                [n, k]; w /= sum(w) when normalize_top_k
    out      = sum_j w_j * expert[ids_j](x)            expert(x) = down(silu(gate(x)) * up(x))
    out     += sigmoid(shared_gate(x)) * shared(x)     only with a shared expert (Qwen2-MoE)

The checkpoint's per-expert tensors are stacked at load into ``gate_up [E, 2I, H]`` and
``down [E, H, I]`` (the layout of transformers 5's ``experts.gate_up_proj``).

The experts run three ways, chosen once per block from the device and dtype:

- **Triton** (CUDA; CPU under ``TRITON_INTERPRET``): :mod:`kvgate.kernels.triton_moe`, a grouped
  GEMM over tokens sorted by expert with the activation and the routing weight fused in.
- **Packed** (CPU float32 with oneDNN): the pairs (token, slot) sorted by expert; each expert's
  rows run through its own oneDNN-packed linears (:class:`~kvgate.executor.linear.Linear`); each
  pair's output lands in its own row and a token's k rows are summed after weighting.
- **Reference** (any other CPU dtype): :func:`kvgate.kernels.torch_moe.fused_experts_reference`.

Why sorted pairs and packed linears on CPU. Measured (``benchmarks/bench_moe_cpu.py``, H 1024:
E 64, k 8, I 512 and E 8, k 2, I 2048; 1 and 2 threads; a 2-core machine under a load of about
2): packed linears are even with ``F.linear`` on the stacked weights at 16 rows and 1.1-2x faster
from 64 rows up; at 1-4 rows they are up to 1.5x slower at 1 thread (oneDNN's one-row kernel),
about even at 2. Gathering each expert's rows once and summing after (sorted) is as fast as
``index_select`` + ``index_add_`` per expert, up to 1.3x faster at 64 rows; gathering every
pair's expert weights for one ``bmm`` is 3-10x slower throughout (it copies weights). Packed
linears also give a row the same bits at every row count (a lone row runs as two in the
batch-invariant mode, like every other linear), so a token's output never depends on which
other tokens share its experts: the batch-invariant mode holds for MoE models.
All three ways are deterministic (no atomics); the packed path sums a token's k outputs slot by
slot, so neither the sum's order nor its bits depend on the batch.

Tensor parallel: every rank holds every expert with its share of the intermediate columns
(gate and up column-parallel, down row-parallel), and of the shared expert's, the router and
the shared expert's gate replicated. Every rank routes the same replicated input identically;
the routed and shared partial sums are added and all-reduced once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.executor.layer_ops import TorchLayerOps
from kvgate.executor.linear import Linear, LinearBackend
from kvgate.executor.moe_config import MoeConfig, expert_names
from kvgate.executor.tensor_parallel.layers import TensorParallel
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.kernels.torch_moe import fused_experts_reference

if TYPE_CHECKING:  # the model imports this module to assemble its sparse layers
    from kvgate.executor.model import BuildContext

# (x [n, H], topk_weights float32 [n, k], topk_ids int64 [n, k]) -> [n, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SharedExpertWeights:
    gate_up: torch.Tensor  # [2 Is, H]: gate and up stacked
    down: torch.Tensor  # [H, Is]
    gate: torch.Tensor  # [1, H]: the sigmoid gate's weight


@dataclass(frozen=True)
class MoeWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2 I, H]: per expert, gate rows [0, I), up rows [I, 2 I)
    down: torch.Tensor  # [E, H, I]
    shared: SharedExpertWeights | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the block (a step reads the router and the experts it routes to)."""
        shared = self.shared
        rest = () if shared is None else (shared.gate_up, shared.down, shared.gate)
        return (self.router, self.gate_up, self.down, *rest)

    def build(self, context: BuildContext) -> MoeBlock:
        """The block that runs these weights (a sparse layer's ``MlpWeights``)."""
        moe = context.config.moe
        assert moe is not None, "MoE weights are only assembled for a config with experts"
        return MoeBlock(
            moe,
            self,
            context.backend,
            context.ops,
            context.parallel,
            batch_invariant=context.batch_invariant,
        )


def assemble_moe_weights(
    moe: MoeConfig, layer: int, tensors: dict[str, torch.Tensor]
) -> MoeWeights:
    """Stack a sparse layer's per-expert checkpoint tensors (shapes checked by the reader)."""
    names = expert_names(moe, layer)
    block = names.block
    experts = [f"{block}.experts.{e}" for e in range(moe.num_experts)]
    gate_up = torch.stack(
        [
            torch.cat([tensors[f"{e}.{names.gate}.weight"], tensors[f"{e}.{names.up}.weight"]])
            for e in experts
        ]
    )
    down = torch.stack([tensors[f"{e}.{names.down}.weight"] for e in experts])
    shared = None
    if moe.shared_expert_intermediate_size is not None:
        base = f"{block}.shared_expert"
        shared = SharedExpertWeights(
            gate_up=torch.cat(
                [tensors[f"{base}.gate_proj.weight"], tensors[f"{base}.up_proj.weight"]]
            ),
            down=tensors[f"{base}.down_proj.weight"],
            gate=tensors[f"{block}.shared_expert_gate.weight"],
        )
    return MoeWeights(tensors[f"{block}.gate.weight"], gate_up, down, shared)


def route(
    router_logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, E]`` logits -> (float32 weights ``[n, k]``, int64 expert ids ``[n, k]``).

    The softmax runs over all experts in float32 before the top-k, and ties are broken by
    ``torch.topk``, as in transformers' routers. Renormalised, the weights equal a softmax over
    the k chosen logits. The weights stay float32 (Mixtral's router keeps them so; Qwen's rounds
    them to the model dtype, the same bits in a float32 model).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class PackedExperts:
    """CPU float32: pairs sorted by expert, each expert's rows through its packed linears."""

    def __init__(
        self, weights: MoeWeights, backend: LinearBackend, ops: TorchLayerOps, batch_invariant: bool
    ):
        def linear(weight: torch.Tensor) -> Linear:
            return Linear.build(weight, None, backend, batch_invariant=batch_invariant)

        self._gate_up = [linear(w) for w in weights.gate_up]
        self._down = [linear(w) for w in weights.down]
        self._ops = ops

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
        counts = torch.bincount(flat, minlength=len(self._down)).tolist()
        sorted_x = x.index_select(0, order // top_k)  # [n k, H]: pair p's token row
        sorted_out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                act = self._ops.silu_and_mul(self._gate_up[expert](sorted_x[rows]))
                sorted_out[rows] = self._down[expert](act)
                start += count
        pair_out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        weighted = pair_out.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)
        # Slot by slot, in order: a token's sum never depends on the rows beside it (a reduction
        # over the slots may pick its summation order by shape).
        out = weighted[:, 0].contiguous()
        for slot in range(1, top_k):
            out += weighted[:, slot]
        return out.to(x.dtype)


def _kernel_experts(weights: MoeWeights) -> ExpertsFn:
    """The Triton kernel where the kernels' dispatch picks Triton, else the torch reference."""
    gate_up, down = weights.gate_up, weights.down
    if select_backend(gate_up.device) is Backend.TRITON:
        # Imported only here: importing Triton fixes its compiled/interpreted mode.
        from kvgate.kernels.triton_moe import fused_experts_triton  # noqa: PLC0415

        return lambda x, w, ids: fused_experts_triton(x, gate_up, down, w, ids)
    return lambda x, w, ids: fused_experts_reference(x, gate_up, down, w, ids)


# exp(r) for |r| <= ln(2)/2: Taylor to degree 7 (truncation below 6e-9, under float32's ulp).
_EXP_TAYLOR = tuple(1.0 / math.factorial(i) for i in range(7, -1, -1))
_INV_LN2 = 1.4426950408889634
_LN2_HI = 0.693145751953125  # 15 significant bits: k * _LN2_HI is exact for |k| <= 256
_LN2_LO = 1.4286068203094173e-06  # ln(2) - _LN2_HI


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / (1 + exp(-x))`` whose value for an element never depends on the tensor
    around it (within 2 ulp of ``torch.sigmoid``).

    ``torch.sigmoid`` on CPU computes most elements in vector registers and a tensor's last few
    in a scalar loop, and the two differ in the last bit for some inputs: the shared expert's
    gate of a token alone and of the same token among others then differ. Here every step is an
    operation IEEE rounds exactly the same in any loop (+, -, x, /, round, integer bit shifts):
    exp(-x) = 2^k exp(r), k = round(-x / ln 2), r by Cody and Waite's two-part ln 2, exp(r) by
    its Taylor polynomial, 2^k built from its exponent bits.
    """
    y = (-x.float()).clamp(-87.0, 87.0)  # 2^k stays a normal float32
    k = torch.round(y * _INV_LN2)
    r = (y - k * _LN2_HI) - k * _LN2_LO
    exp_r = torch.full_like(r, _EXP_TAYLOR[0])
    for coefficient in _EXP_TAYLOR[1:]:
        exp_r = exp_r * r + coefficient
    two_to_k = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return 1.0 / (1.0 + exp_r * two_to_k)


class _SharedExpert:
    """``sigmoid(gate(x)) * down(silu(gate_proj(x)) * up_proj(x))``; in tensor parallel the
    projections are this rank's shard (a partial sum) and the sigmoid gate is replicated. The
    batch-invariant mode takes :func:`invariant_sigmoid`."""

    def __init__(
        self,
        weights: SharedExpertWeights,
        backend: LinearBackend,
        ops: TorchLayerOps,
        batch_invariant: bool,
    ):
        def linear(weight: torch.Tensor) -> Linear:
            return Linear.build(weight, None, backend, batch_invariant=batch_invariant)

        self._gate_up, self._down, self._gate = map(
            linear, (weights.gate_up, weights.down, weights.gate)
        )
        self._ops = ops
        self._sigmoid = invariant_sigmoid if batch_invariant else torch.sigmoid

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._down(self._ops.silu_and_mul(self._gate_up(x)))
        return self._sigmoid(self._gate(x)) * out


class MoeBlock:
    """A sparse layer's MLP: ``x [n, H] -> [n, H]`` (module docstring), on one rank or sharded."""

    def __init__(
        self,
        config: MoeConfig,
        weights: MoeWeights,
        backend: LinearBackend,
        ops: TorchLayerOps,
        parallel: TensorParallel | None = None,
        *,
        batch_invariant: bool = False,
    ):
        self.config = config
        self._router = Linear.build(weights.router, None, backend, batch_invariant=batch_invariant)
        self._experts: ExpertsFn
        if select_backend(weights.gate_up.device) is Backend.TORCH and (
            backend is LinearBackend.ONEDNN
        ):
            self._experts = PackedExperts(weights, backend, ops, batch_invariant)
        elif batch_invariant:
            raise ValueError("batch-invariant experts need oneDNN's packed linears (CPU fp32)")
        else:
            self._experts = _kernel_experts(weights)
        self._shared = (
            None
            if weights.shared is None
            else _SharedExpert(weights.shared, backend, ops, batch_invariant)
        )
        self._parallel = parallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route(
            self._router(x), self.config.top_k, self.config.normalize_top_k
        )
        out = self._experts(x, topk_weights, topk_ids)
        if self._shared is not None:
            out = out + self._shared(x)
        return out if self._parallel is None else self._parallel.all_reduce(out)
