"""The building blocks every decoder layer is assembled from, chosen once per layer at load.

A block is a small frozen object with one call signature; where families differ, the layer holds
a different block (a norm or the identity, a fused add + norm or a plain add, a SiLU or a GELU
MLP), never a flag tested inside the forward. The model (:mod:`kvgate.executor.model`) strings
them together:

```
x = attention_in(h)                                   first layer's input norm (or identity)
for each layer:
    a = attention_out(attention(x))                   qkv, QK-norm, RoPE, attention, o
    h, x = after_attention(a, h)                      h + a, then mlp_in's norm (or h + a twice)
    m = mlp_out(mlp(x))                               the MLP block (dense, or another kind)
    h, x = after_mlp(m, h)                            h + m, then the next layer's attention_in
```
Norms run through the layer operations (:mod:`kvgate.executor.layer_ops`), compiled on CPU
float32; the residual add is fused with the norm that reads its sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvgate.executor.layer_ops import TorchLayerOps
from kvgate.executor.rope import Rotation
from kvgate.executor.tensor_parallel.layers import TensorParallel

# [n, in] -> [n, out]: a Linear, or a row-parallel one that sums over ranks.
LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention weighs its keys (the same for every token of a step)."""

    softmax_scale: float  # scores are (q . k) * softmax_scale
    # The query at position p attends to keys at p - W < k <= p; None: every k <= p. Never a
    # window that cannot bind (>= the context length): that is None, so it costs no plan.
    sliding_window: int | None = None
    logit_softcap: float | None = None  # scores s become c * tanh(s / c) before the softmax


# (layer, its attention settings, query [n, Hq, D], key [n, Hkv, D], value [n, Hkv, D]) ->
# attention output [n, Hq, D]; q, k and v are views of one fused projection (strided in dim 0,
# head vectors contiguous).
AttentionFn = Callable[
    [int, LayerAttention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class Block(Protocol):
    """``[n, H] -> [n, H]``: a norm, the identity, an MLP."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Residual(Protocol):
    """``(out, hidden) -> (hidden + out, the next block's input)``."""

    def __call__(
        self, out: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# --------------------------------------------------------------------------------- norms


@dataclass(frozen=True)
class RmsNorm:
    weight: torch.Tensor  # [H], any stored offset already folded in (see Architecture)
    eps: float
    ops: TorchLayerOps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Identity:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class AddNorm:
    """The residual add fused with the norm of the block that reads the sum."""

    norm: RmsNorm

    def __call__(
        self, out: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.norm
        return norm.ops.add_rms_norm(out, hidden, norm.weight, norm.eps)


class Add:
    """The residual add where the next block reads the sum itself (no norm in between)."""

    def __call__(
        self, out: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = hidden + out
        return total, total


@dataclass(frozen=True)
class SoftCap:
    """``c * tanh(x / c)``: values squashed smoothly into ``(-c, c)`` (Gemma 2's final logits)."""

    cap: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(x / self.cap)


def softcap_block(cap: float | None) -> Block:
    return Identity() if cap is None else SoftCap(cap)


def norm_block(weight: torch.Tensor | None, eps: float, ops: TorchLayerOps) -> Block:
    return Identity() if weight is None else RmsNorm(weight, eps, ops)


def residual_block(next_norm: torch.Tensor | None, eps: float, ops: TorchLayerOps) -> Residual:
    return Add() if next_norm is None else AddNorm(RmsNorm(next_norm, eps, ops))


# ------------------------------------------------------------------------------ QK norms


class QkNormFn(Protocol):
    """Normalizes the q and k heads of ``qkv [n, Hq + 2 Hkv, D]`` in place, before RoPE."""

    def __call__(self, qkv: torch.Tensor) -> None: ...


class NoQkNorm:
    def __call__(self, qkv: torch.Tensor) -> None:
        return None


@dataclass(frozen=True)
class PerHeadQkNorm:
    """One ``[D]`` weight over every query head, another over every key head (Qwen3, Gemma 3).
    A head is normalized on its own, so tensor-parallel ranks need nothing from one another."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float
    num_q_heads: int
    num_kv_heads: int
    ops: TorchLayerOps

    def __call__(self, qkv: torch.Tensor) -> None:
        n, d = qkv.shape[0], qkv.shape[2]
        q_heads, kv_heads = self.num_q_heads, self.num_kv_heads
        q, k = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads]
        q.copy_(self.ops.rms_norm(q.reshape(n * q_heads, d), self.q_weight, self.eps).view_as(q))
        k.copy_(self.ops.rms_norm(k.reshape(n * kv_heads, d), self.k_weight, self.eps).view_as(k))


@dataclass(frozen=True)
class WholeProjectionQkNorm:
    """One weight over all query heads together, another over all key heads (OLMo 2): the
    mean square runs over the whole projection's width, ``Hq * D`` and ``Hkv * D``.

    Tensor-parallel, a rank holds some of the heads: it sums its squares, the ranks all-reduce
    the sums, and the mean divides by ``world_size * local width``. That is the whole width
    whether the KV heads are split (each rank ``Hkv / N`` of them) or replicated (each rank one,
    every head counted ``N / Hkv`` times in the sum).
    """

    q_weight: torch.Tensor  # [local Hq * D], this rank's slice
    k_weight: torch.Tensor  # [local Hkv * D]
    eps: float
    num_q_heads: int  # local
    num_kv_heads: int  # local
    ops: TorchLayerOps
    parallel: TensorParallel | None

    def __call__(self, qkv: torch.Tensor) -> None:
        q_heads, kv_heads = self.num_q_heads, self.num_kv_heads
        q, k = qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads]
        for heads, weight in ((q, self.q_weight), (k, self.k_weight)):
            flat = heads.flatten(1)  # [n, heads * D], a view: each row's heads are adjacent
            heads.copy_(self._norm(flat, weight).view_as(heads))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            return self.ops.rms_norm(x, weight, self.eps)
        x_float = x.float()
        squares = self.parallel.all_reduce(x_float.pow(2).sum(-1, keepdim=True))
        mean = squares / (self.parallel.plan.world_size * x.shape[1])
        return weight * (x_float * torch.rsqrt(mean + self.eps)).to(x.dtype)


# ------------------------------------------------------------------------------ attention


@dataclass(frozen=True)
class AttentionBlock:
    """qkv projection, QK-norm, RoPE, attention (a callback: paged or dense), o projection."""

    qkv: LinearFn  # [n, H] -> [n, (Hq + 2 Hkv) D]
    o: LinearFn  # [n, Hq D] -> [n, H]
    qk_norm: QkNormFn
    settings: LayerAttention
    rope: int  # index of this layer's rotary table in the model
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ops: TorchLayerOps

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,  # [n, H]: the attention input norm's output
        rotation: Rotation,
        attention: AttentionFn,
    ) -> torch.Tensor:  # [n, H], before any output norm and the residual add
        n, q_heads, kv_heads = x.shape[0], self.num_q_heads, self.num_kv_heads
        # [n, Hq + 2 Hkv, D]: q and k heads are adjacent, so one rotation covers both.
        qkv = self.qkv(x).view(n, q_heads + 2 * kv_heads, self.head_dim)
        self.qk_norm(qkv)
        q, k, v = self.ops.rotate_qk(qkv, rotation, q_heads, kv_heads)
        out = attention(layer, self.settings, q, k, v)
        return self.o(out.reshape(n, q_heads * self.head_dim))


# ------------------------------------------------------------------------------------ MLP


@dataclass(frozen=True)
class GatedMlp:
    """The dense MLP ``down(act(gate(x)) * up(x))``, gate and up in one matmul."""

    gate_up: LinearFn  # [n, H] -> [n, 2 I]: gate, then up
    down: LinearFn  # [n, I] -> [n, H]
    act_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [n, 2 I] -> [n, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_and_mul(self.gate_up(x)))


# ------------------------------------------------------------------------------- the layer


@dataclass(frozen=True)
class DecoderLayer:
    attention: AttentionBlock
    attention_out: Block  # norm of the attention output before the add, or the identity
    after_attention: Residual  # the add, then the MLP's input norm
    mlp: Block
    mlp_out: Block
    after_mlp: Residual  # the add, then the next layer's input norm (a plain add at the end)
