"""The transformer math shared by the paged executor and the unpaged reference.

A model is three stages: the prelude (embedding), a core pass (every layer once, plus the Ouro
end-of-loop norm) that a looped model runs up to ``num_loops`` times per token, and the coda
(logits). Attention is a callback, so the same core pass serves a paged KV cache (the executor)
and contiguous per-request tensors (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kvgate.gpu_executor.config import ModelConfig
from kvgate.gpu_executor.layer_ops import TorchLayerOps, select_layer_ops
from kvgate.gpu_executor.linear import Linear, LinearBackend, select_linear_backend
from kvgate.gpu_executor.rope import RotaryTable, Rotation
from kvgate.gpu_executor.tensor_parallel.layers import (
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from kvgate.gpu_executor.weights import layer_prefix
from kvgate.protocol.enums import ModelFamily

# (layer, query [n, Hq, D], key [n, Hkv, D], value [n, Hkv, D]) -> attention output [n, Hq, D];
# q, k and v are views of one fused projection (strided in dim 0, head vectors contiguous).
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# [n, in] -> [n, out]: a Linear, or a row-parallel one that sums over ranks.
LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    qkv_proj: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q, k and v stacked for one matmul
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o_proj: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None  # [H]
    gate_up_proj: torch.Tensor  # [2 I, H]: gate and up stacked
    down_proj: torch.Tensor  # [H, I]
    input_norm: torch.Tensor  # [H]
    post_attention_norm: torch.Tensor  # [H]
    attention_out_norm: torch.Tensor | None  # [H], Ouro's input_layernorm_2
    mlp_out_norm: torch.Tensor | None  # [H], Ouro's post_attention_layernorm_2


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied
    exit_gate: torch.Tensor | None  # [1, H]
    exit_gate_bias: torch.Tensor | None  # [1]


def assemble_weights(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    """Group checkpoint tensors (already checked by ``read_checkpoint``) into fused layers."""
    layers = []
    for layer in range(config.num_layers):
        attn = f"{layer_prefix(layer)}.self_attn"
        mlp = f"{layer_prefix(layer)}.mlp"
        qkv = [tensors[f"{attn}.{p}_proj.weight"] for p in "qkv"]
        layers.append(
            LayerWeights(
                qkv_proj=torch.cat(qkv, dim=0),
                qkv_bias=(
                    torch.cat([tensors[f"{attn}.{p}_proj.bias"] for p in "qkv"])
                    if config.qkv_bias
                    else None
                ),
                o_proj=tensors[f"{attn}.o_proj.weight"],
                o_bias=tensors.get(f"{attn}.o_proj.bias"),
                gate_up_proj=torch.cat(
                    [tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]]
                ),
                down_proj=tensors[f"{mlp}.down_proj.weight"],
                input_norm=tensors[f"{layer_prefix(layer)}.input_layernorm.weight"],
                post_attention_norm=tensors[
                    f"{layer_prefix(layer)}.post_attention_layernorm.weight"
                ],
                attention_out_norm=tensors.get(f"{layer_prefix(layer)}.input_layernorm_2.weight"),
                mlp_out_norm=tensors.get(
                    f"{layer_prefix(layer)}.post_attention_layernorm_2.weight"
                ),
            )
        )
    embed = tensors["model.embed_tokens.weight"]
    return ModelWeights(
        embed=embed,
        layers=tuple(layers),
        norm=tensors["model.norm.weight"],
        lm_head=embed if config.tie_word_embeddings else tensors["lm_head.weight"],
        exit_gate=tensors.get("model.early_exit_gate.weight"),
        exit_gate_bias=tensors.get("model.early_exit_gate.bias"),
    )


@dataclass(frozen=True)
class _LayerLinears:
    """One layer's four matmuls, built from its ``LayerWeights`` for the chosen backend.

    Tensor-parallel: ``qkv`` and ``gate_up`` are this rank's column shards (plain linears), ``o``
    and ``down`` its row shards, whose partial sums are all-reduced.
    """

    qkv: LinearFn
    o: LinearFn
    gate_up: LinearFn
    down: LinearFn

    @classmethod
    def build(
        cls, layer: LayerWeights, backend: LinearBackend, *, batch_invariant: bool = False
    ) -> _LayerLinears:
        def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
            return Linear.build(weight, bias, backend, batch_invariant=batch_invariant)

        return cls(
            qkv=linear(layer.qkv_proj, layer.qkv_bias),
            o=linear(layer.o_proj, layer.o_bias),
            gate_up=linear(layer.gate_up_proj, None),
            down=linear(layer.down_proj, None),
        )

    @classmethod
    def build_sharded(
        cls, layer: LayerWeights, backend: LinearBackend, parallel: TensorParallel
    ) -> _LayerLinears:
        return cls(
            qkv=Linear.build(layer.qkv_proj, layer.qkv_bias, backend),
            o=RowParallelLinear(Linear.build(layer.o_proj, None, backend), layer.o_bias, parallel),
            gate_up=Linear.build(layer.gate_up_proj, None, backend),
            down=RowParallelLinear(Linear.build(layer.down_proj, None, backend), None, parallel),
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
        self.dtype = weights.embed.dtype
        backend = self.linear_backend = linear_backend or select_linear_backend(
            self.device, self.dtype
        )
        self.ops = layer_ops or select_layer_ops(self.device, self.dtype)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            _check_batch_invariant(self.device, self.dtype, backend, self.ops, parallel)
        self._linears: tuple[_LayerLinears, ...]
        self._embed: LinearFn
        self._lm_head: LinearFn
        self._exit_gate: LinearFn | None = None
        if parallel is None:
            self._linears = tuple(
                _LayerLinears.build(layer, backend, batch_invariant=batch_invariant)
                for layer in weights.layers
            )
            self._embed = partial(F.embedding, weight=weights.embed)
            self._lm_head = Linear.build(
                weights.lm_head, None, backend, batch_invariant=batch_invariant
            )
            if batch_invariant and weights.exit_gate is not None:
                self._exit_gate = Linear.build(
                    weights.exit_gate, weights.exit_gate_bias, backend, batch_invariant=True
                )
        else:
            self._linears = tuple(
                _LayerLinears.build_sharded(layer, backend, parallel) for layer in weights.layers
            )
            start = parallel.plan.vocab_start(config.vocab_size)
            self._embed = VocabParallelEmbedding(weights.embed, start, parallel)
            self._lm_head = VocabParallelHead(
                Linear.build(weights.lm_head, None, backend), config.vocab_size, parallel
            )
        self.rotary = RotaryTable(
            config.head_dim, config.rope_theta, config.rope_scaling, self.device
        )
        self.softmax_scale = config.head_dim**-0.5
        self._q_dim = config.num_heads * config.head_dim

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` -> hidden ``[n, H]``."""
        return self._embed(token_ids)

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
        cfg, ops, layers = self.config, self.ops, self.weights.layers
        rotation = self.rotary.at(positions, max_position)  # the same for every layer
        x = ops.rms_norm(hidden, layers[0].input_norm, cfg.rms_norm_eps)
        for index, (layer, linears) in enumerate(zip(layers, self._linears, strict=True)):
            attn = self._attention_block(index, layer, linears, x, rotation, attention)
            hidden, x = ops.add_rms_norm(attn, hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            mlp = linears.down(ops.silu_and_mul(linears.gate_up(x)))
            if layer.mlp_out_norm is not None:
                mlp = ops.rms_norm(mlp, layer.mlp_out_norm, cfg.rms_norm_eps)
            if index + 1 < len(layers):
                next_norm = layers[index + 1].input_norm
                hidden, x = ops.add_rms_norm(mlp, hidden, next_norm, cfg.rms_norm_eps)
            else:
                hidden = hidden + mlp
        if cfg.norm_every_loop:
            hidden = ops.rms_norm(hidden, self.weights.norm, cfg.rms_norm_eps)
        return hidden

    def _attention_block(
        self,
        index: int,
        layer: LayerWeights,
        linears: _LayerLinears,
        x: torch.Tensor,  # [n, H]: the input norm's output
        rotation: Rotation,
        attention: AttentionFn,
    ) -> torch.Tensor:  # [n, H], before the residual add
        cfg = self.config
        n = x.shape[0]
        # [n, Hq + 2 Hkv, D]: q and k heads are adjacent, so one rotation covers both.
        qkv = linears.qkv(x).view(n, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        q, k, v = self.ops.rotate_qk(qkv, rotation, cfg.num_heads, cfg.num_kv_heads)
        attn = linears.o(attention(index, q, k, v).reshape(n, self._q_dim))
        if layer.attention_out_norm is not None:
            attn = self.ops.rms_norm(attn, layer.attention_out_norm, cfg.rms_norm_eps)
        return attn

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
        """The coda: hidden ``[n, H]`` after the exit pass -> fp32 logits ``[n, V]``."""
        if self.config.family is ModelFamily.LLAMA:
            hidden = self.ops.rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)
        return self._lm_head(hidden).float()
