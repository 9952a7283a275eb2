"""The transformer math shared by the paged executor and the unpaged reference.

A model is three stages: the prelude (embedding), a core pass (every layer once, plus the Ouro
end-of-loop norm) that a looped model runs up to ``num_loops`` times per token, and the coda
(logits). Attention is a callback, so the same core pass serves a paged KV cache (the executor)
and contiguous per-request tensors (the reference).

Every family is the same loop over layers built from :mod:`kvgate.executor.blocks`; the family's
:class:`~kvgate.executor.architecture.Architecture` (looked up by ``model_type``) decides, once
at load, which blocks each layer holds (:func:`build_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvgate.executor.architecture import Activation, QkNorm
from kvgate.executor.blocks import (
    AttentionBlock,
    AttentionFn,
    Block,
    DecoderLayer,
    GatedMlp,
    Identity,
    LayerAttention,
    LinearFn,
    NoQkNorm,
    PerHeadQkNorm,
    QkNormFn,
    WholeProjectionQkNorm,
    norm_block,
    residual_block,
    softcap_block,
)
from kvgate.executor.config import ModelConfig
from kvgate.executor.layer_ops import TorchLayerOps, select_layer_ops
from kvgate.executor.linear import Linear, LinearBackend, select_linear_backend
from kvgate.executor.moe import assemble_moe_weights
from kvgate.executor.quantized import Weight, dense, embedding, stack_rows
from kvgate.executor.rope import RotaryTable
from kvgate.executor.tensor_parallel.layers import (
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from kvgate.executor.weights import layer_tensor_names

__all__ = ["AttentionFn", "LayerAttention", "Model", "ModelWeights", "assemble_weights"]


@dataclass(frozen=True)
class BuildContext:
    """What turns weights into blocks on this device: the linear backend, the layer operations,
    the tensor-parallel group (None: one device) and the batch-invariant mode."""

    config: ModelConfig
    backend: LinearBackend
    ops: TorchLayerOps
    parallel: TensorParallel | None
    batch_invariant: bool

    def linear(self, weight: Weight, bias: torch.Tensor | None = None) -> Linear:
        """A column-parallel (or single-device) linear: each rank's rows are its own output."""
        return Linear.build(weight, bias, self.backend, batch_invariant=self.batch_invariant)

    def row_parallel(self, weight: Weight, bias: torch.Tensor | None = None) -> LinearFn:
        """A linear whose input columns are split over ranks: partial sums, all-reduced."""
        if self.parallel is None:
            return self.linear(weight, bias)
        return RowParallelLinear(Linear.build(weight, None, self.backend), bias, self.parallel)


class MlpWeights(Protocol):
    """A layer's MLP weights; ``build`` makes the block (``[n, H] -> [n, H]``) that runs them."""

    def build(self, context: BuildContext) -> Block: ...

    def tensors(self) -> tuple[Weight, ...]: ...


@dataclass(frozen=True)
class DenseMlpWeights:
    gate_up_proj: Weight  # [2 I, H]: gate and up stacked
    down_proj: Weight  # [H, I]

    def build(self, context: BuildContext) -> Block:
        act_and_mul = {
            Activation.SILU: context.ops.silu_and_mul,
            Activation.GELU_TANH: context.ops.gelu_tanh_and_mul,
        }[context.config.activation]
        return GatedMlp(
            context.linear(self.gate_up_proj),
            context.row_parallel(self.down_proj),
            act_and_mul,
        )

    def tensors(self) -> tuple[Weight, ...]:
        return (self.gate_up_proj, self.down_proj)


@dataclass(frozen=True)
class LayerWeights:
    qkv_proj: Weight  # [(Hq + 2 Hkv) D, H]: q, k and v stacked for one matmul
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o_proj: Weight  # [H, Hq D]
    o_bias: torch.Tensor | None  # [H]
    q_norm: torch.Tensor | None  # [D] per head, or [Hq D] over the whole projection
    k_norm: torch.Tensor | None  # [D] or [Hkv D]
    mlp: MlpWeights
    # Norm weights by slot (attention_in, attention_out, mlp_in, mlp_out; see Architecture),
    # only the slots the family has, any stored offset folded in.
    norms: dict[str, torch.Tensor]

    def tensors(self) -> tuple[Weight, ...]:
        """Every tensor of the layer (what a step reads)."""
        attention = (self.qkv_proj, self.qkv_bias, self.o_proj, self.o_bias)
        optional = (*attention, self.q_norm, self.k_norm)
        present = tuple(t for t in optional if t is not None)
        return (*present, *self.mlp.tensors(), *self.norms.values())


@dataclass(frozen=True)
class ModelWeights:
    embed: Weight  # [V, H]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H], offset folded in
    lm_head: Weight  # [V, H]; the embedding itself when tied
    exit_gate: torch.Tensor | None  # [1, H]
    exit_gate_bias: torch.Tensor | None  # [1]


def assemble_weights(config: ModelConfig, tensors: Mapping[str, Weight]) -> ModelWeights:
    """Group checkpoint tensors (already checked by ``read_checkpoint``) into fused layers."""
    offset = config.architecture.norm_weight_offset

    def norm(name: str) -> torch.Tensor:
        # Gemma's (1 + w): folded once here; in float32 the product is the same bits.
        weight = dense(tensors[name])
        return weight + offset if offset else weight

    # Experts run float weights only: dense() refuses a quantized one by name.
    moe_tensors = None if config.moe is None else {n: dense(t) for n, t in tensors.items()}
    layers = []
    for layer in range(config.num_layers):
        names = layer_tensor_names(config, layer)
        layers.append(
            LayerWeights(
                qkv_proj=_stacked(tensors, names.qkv),
                qkv_bias=dense(_stacked(tensors, names.qkv_bias)) if names.qkv_bias else None,
                o_proj=tensors[names.o_proj],
                o_bias=dense(tensors[names.o_bias]) if names.o_bias else None,
                q_norm=norm(names.q_norm) if names.q_norm else None,
                k_norm=norm(names.k_norm) if names.k_norm else None,
                mlp=(
                    assemble_moe_weights(config.moe, layer, moe_tensors)
                    if config.moe is not None
                    and moe_tensors is not None
                    and config.moe.is_sparse(layer)
                    else DenseMlpWeights(
                        gate_up_proj=_stacked(tensors, names.gate_up),
                        down_proj=tensors[names.down_proj],
                    )
                ),
                norms={slot: norm(name) for slot, name in names.norms.items()},
            )
        )
    embed = tensors["model.embed_tokens.weight"]
    return ModelWeights(
        embed=embed,
        layers=tuple(layers),
        norm=norm("model.norm.weight"),
        lm_head=embed if config.tie_word_embeddings else tensors["lm_head.weight"],
        exit_gate=_optional_dense(tensors.get("model.early_exit_gate.weight")),
        exit_gate_bias=_optional_dense(tensors.get("model.early_exit_gate.bias")),
    )


def _stacked(tensors: Mapping[str, Weight], names: tuple[str, ...]) -> Weight:
    """One tensor as stored (a fused checkpoint), or the parts stacked along dim 0."""
    return tensors[names[0]] if len(names) == 1 else stack_rows([tensors[n] for n in names])


def _optional_dense(weight: Weight | None) -> torch.Tensor | None:
    return None if weight is None else dense(weight)


def _qk_norm(config: ModelConfig, layer: LayerWeights, context: BuildContext) -> QkNormFn:
    if layer.q_norm is None or layer.k_norm is None:
        return NoQkNorm()
    heads = (config.num_heads, config.num_kv_heads)
    if config.architecture.qk_norm is QkNorm.PER_HEAD:
        return PerHeadQkNorm(layer.q_norm, layer.k_norm, config.rms_norm_eps, *heads, context.ops)
    return WholeProjectionQkNorm(
        layer.q_norm, layer.k_norm, config.rms_norm_eps, *heads, context.ops, context.parallel
    )


def build_layer(
    index: int,
    layer: LayerWeights,
    next_attention_in: torch.Tensor | None,
    rope: int,
    context: BuildContext,
) -> DecoderLayer:
    """One decoder layer's blocks; ``next_attention_in`` is the next layer's input norm (None
    for the last layer and for families without one), fused into this layer's last add."""
    config, ops, eps = context.config, context.ops, context.config.rms_norm_eps
    attention = AttentionBlock(
        qkv=context.linear(layer.qkv_proj, layer.qkv_bias),
        o=context.row_parallel(layer.o_proj, layer.o_bias),
        qk_norm=_qk_norm(config, layer, context),
        settings=LayerAttention(
            softmax_scale=config.softmax_scale,
            sliding_window=config.layer_window(index),
            logit_softcap=config.attn_logit_softcap,
        ),
        rope=rope,
        num_q_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        ops=ops,
    )
    return DecoderLayer(
        attention=attention,
        attention_out=norm_block(layer.norms.get("attention_out"), eps, ops),
        after_attention=residual_block(layer.norms.get("mlp_in"), eps, ops),
        mlp=layer.mlp.build(context),
        mlp_out=norm_block(layer.norms.get("mlp_out"), eps, ops),
        after_mlp=residual_block(next_attention_in, eps, ops),
    )


def _check_batch_invariant(
    device: torch.device,
    dtype: torch.dtype,
    backend: LinearBackend,
    ops: TorchLayerOps,
    parallel: TensorParallel | None,
) -> None:
    """Raise unless this model can run batch-invariant (see :class:`Model`)."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"batch-invariant mode runs on CPU in float32 (this model: {device.type}, {dtype}); "
            "the CUDA kernels choose splits by batch size"
        )
    if backend is not LinearBackend.ONEDNN:
        raise ValueError("batch-invariant mode needs oneDNN's packed linears (torch built with it)")
    if not ops.compiled:
        raise ValueError(
            "batch-invariant mode needs kvgate's compiled CPU kernels (a C++ compiler at startup)"
        )
    if parallel is not None:
        raise ValueError("batch-invariant mode runs on one device (no tensor parallelism)")


class Model:
    """A loaded model on one device: prelude, core pass, exit gate and coda.

    With ``parallel``, ``config`` and ``weights`` are this rank's shard (its heads and MLP
    columns, its vocabulary rows; ``config.vocab_size`` stays the whole vocabulary), and the
    row-parallel layers, the embedding and the LM head combine the ranks' parts. Without it no
    layer knows ranks exist: the single-device path runs exactly the same calls as before.

    ``batch_invariant``: a row's outputs do not depend on the other rows of its step, nor on how
    its prompt was cut into chunks (every linear gives a lone row the bits it gets in a batch,
    and attention sums every prefill token in a decode row's order). CPU float32 with the
    compiled kernels only, one device; a ValueError says which of these is missing.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        linear_backend: LinearBackend | None = None,
        parallel: TensorParallel | None = None,
        layer_ops: TorchLayerOps | None = None,
        *,
        batch_invariant: bool = False,
    ):
        self.config = config
        self.weights = weights
        self.parallel = parallel
        self.device = weights.embed.device
        self.dtype = weights.norm.dtype  # the activations' (quantized matrices have none)
        backend = self.linear_backend = linear_backend or select_linear_backend(
            self.device, self.dtype
        )
        self.ops = layer_ops or select_layer_ops(self.device, self.dtype)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            _check_batch_invariant(self.device, self.dtype, backend, self.ops, parallel)
        context = BuildContext(config, backend, self.ops, parallel, batch_invariant)
        architecture, eps = config.architecture, config.rms_norm_eps
        # One rotary table per distinct RoPE (Gemma 3: local and global layers differ).
        ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = list(dict.fromkeys(ropes))
        self.rotaries = tuple(
            RotaryTable(config.head_dim, r.theta, r.scaling, self.device) for r in distinct
        )
        layer_norms = [layer.norms.get("attention_in") for layer in weights.layers]
        self.layers = tuple(
            build_layer(i, layer, next_in, distinct.index(ropes[i]), context)
            for i, (layer, next_in) in enumerate(
                zip(weights.layers, [*layer_norms[1:], None], strict=True)
            )
        )
        self._first_norm = norm_block(layer_norms[0], eps, self.ops)
        final_norm = norm_block(weights.norm, eps, self.ops)
        self._end_of_pass: Block = final_norm if architecture.final_norm_every_loop else Identity()
        self._coda_norm: Block = Identity() if architecture.final_norm_every_loop else final_norm
        self._embed: LinearFn
        self._lm_head: LinearFn
        self._exit_gate: LinearFn | None = None
        if parallel is None:
            self._embed = embedding(weights.embed, self.dtype)
            self._lm_head = context.linear(weights.lm_head)
            if batch_invariant and weights.exit_gate is not None:
                self._exit_gate = context.linear(weights.exit_gate, weights.exit_gate_bias)
        else:
            start = parallel.plan.vocab_start(config.vocab_size)
            self._embed = VocabParallelEmbedding(dense(weights.embed), start, parallel)
            self._lm_head = VocabParallelHead(
                Linear.build(weights.lm_head, None, backend), config.vocab_size, parallel
            )
        self._logit_cap = softcap_block(config.final_logit_softcap)
        # Gemma: embeddings times √H, rounded to the weights' dtype first (as transformers does).
        self._embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=self.device)
            if architecture.scale_embedding
            else None
        )

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (None: full causal), in layer order."""
        windows = (layer.attention.settings.sliding_window for layer in self.layers)
        return tuple(dict.fromkeys(windows))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` -> hidden ``[n, H]``."""
        hidden = self._embed(token_ids)
        return hidden if self._embed_scale is None else hidden * self._embed_scale

    def core_pass(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        max_position: int,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """One pass through every layer: hidden ``[n, H]`` at int64 ``positions [n]``.

        Each residual add is fused with the norm that reads its sum (the next sub-layer's
        input norm), so a layer is: attention block, add + norm, MLP block, add + next norm.
        """
        # One rotation per distinct RoPE, shared by every layer that applies it.
        rotations = [table.at(positions, max_position) for table in self.rotaries]
        x = self._first_norm(hidden)
        for index, layer in enumerate(self.layers):
            block = layer.attention
            attn = layer.attention_out(block(index, x, rotations[block.rope], attention))
            hidden, x = layer.after_attention(attn, hidden)
            hidden, x = layer.after_mlp(layer.mlp_out(layer.mlp(x)), hidden)
        return self._end_of_pass(hidden)

    def exit_hazard(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[n]``: the gate's probability of exiting after this pass, given no exit before.

        Only looped models have a gate; for them ``hidden`` is the end-of-loop (normed) state.
        """
        if self.weights.exit_gate is None:
            raise ValueError(f"a {self.config.family} model has no exit gate")
        gate = (
            F.linear(hidden, self.weights.exit_gate, self.weights.exit_gate_bias)
            if self._exit_gate is None
            else self._exit_gate(hidden)
        )
        return torch.sigmoid(gate.float()).squeeze(-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The coda: hidden ``[n, H]`` after the exit pass -> fp32 logits ``[n, V]``.

        A final soft-cap (Gemma 2) runs on the fp32 logits: ``c * tanh(logits / c)``.
        """
        return self._logit_cap(self._lm_head(self._coda_norm(hidden)).float())
