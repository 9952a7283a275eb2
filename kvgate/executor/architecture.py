"""What a decoder layer is made of, model type by model type: the recipe the model is built from.

Every family kvgate runs is one decoder layer repeated, assembled from a few building blocks
(:mod:`kvgate.executor.blocks`). A recipe names which blocks a layer has and under which tensor
names the checkpoint stores their weights; nothing else differs between the families:

```
                 attention_in   attention_out     mlp_in                    mlp_out
llama, qwen2,    input_        -                 post_attention_           -
mistral, qwen3,  layernorm                       layernorm
phi3
ouro             input_        input_            post_attention_           post_attention_
                 layernorm     layernorm_2       layernorm                 layernorm_2
gemma2,          input_        post_attention_   pre_feedforward_          post_feedforward_
gemma3_text      layernorm     layernorm         layernorm                 layernorm
olmo2            -             post_attention_   -                         post_feedforward_
                               layernorm                                   layernorm
```
A layer computes ``h += attention_out(attn(attention_in(h)))``, then
``h += mlp_out(mlp(mlp_in(h)))``; a missing norm is the identity. The same tensor name means
different slots in different families (``post_attention_layernorm`` feeds Llama's MLP but
normalizes Gemma's attention output), which is why the names are part of the recipe.

This module imports no torch: a recipe is plain data, looked up by ``model_type`` in
:data:`kvgate.executor.config_keys.MODEL_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Activation(StrEnum):
    """The gate's activation of the gated MLP ``down(act(gate(x)) * up(x))``."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"  # GELU with the tanh approximation (Gemma)


class QkNorm(StrEnum):
    """An RMSNorm of the queries and keys after the projection, before RoPE."""

    NONE = "none"
    PER_HEAD = "per_head"  # one [head_dim] weight applied to every head (Qwen3, Gemma 3)
    WHOLE_PROJECTION = "whole_projection"  # one [heads * head_dim] weight, over all heads (OLMo 2)


class WindowRule(StrEnum):
    """What a config's ``sliding_window`` does to the model."""

    # Sliding layers attend to the last ``sliding_window`` positions (transformers' masks).
    PER_LAYER = "per_layer"
    # The context is capped at the window, where sliding and full attention agree: for types
    # whose transformers code ignores the key (Llama, OLMo 2) or that kvgate serves without knowing
    # which of their layers slide (Ouro's remote code).
    CAPS_CONTEXT = "caps_context"


@dataclass(frozen=True)
class NormNames:
    """The checkpoint name (under ``model.layers.{i}.``) of each norm of a layer; None: none."""

    attention_in: str | None
    attention_out: str | None
    mlp_in: str | None
    mlp_out: str | None

    def slots(self) -> dict[str, str]:
        """slot -> tensor name of the norms the layer has."""
        named = {
            "attention_in": self.attention_in,
            "attention_out": self.attention_out,
            "mlp_in": self.mlp_in,
            "mlp_out": self.mlp_out,
        }
        return {slot: name for slot, name in named.items() if name is not None}


@dataclass(frozen=True)
class Architecture:
    """One family's decoder layer and the model around it."""

    name: str
    norms: NormNames
    qk_norm: QkNorm = QkNorm.NONE
    fused_qkv: bool = False  # self_attn.qkv_proj holds q, k, v stacked (Phi-3)
    fused_gate_up: bool = False  # mlp.gate_up_proj holds gate and up stacked (Phi-3)
    # RMSNorm weights stored as offsets from 1, the norm computing (1 + w) * x̂ (Gemma): folded
    # into the weight at load, so every norm block computes w * x̂.
    norm_weight_offset: float = 0.0
    scale_embedding: bool = False  # embeddings multiplied by √hidden_size (Gemma)
    final_norm_every_loop: bool = False  # Ouro: the final norm ends every loop, not the coda
    exit_gate: bool = False  # Ouro: model.early_exit_gate
    window: WindowRule = WindowRule.PER_LAYER


_PRE_NORM = NormNames(
    attention_in="input_layernorm",
    attention_out=None,
    mlp_in="post_attention_layernorm",
    mlp_out=None,
)
_GEMMA_NORMS = NormNames(
    attention_in="input_layernorm",
    attention_out="post_attention_layernorm",
    mlp_in="pre_feedforward_layernorm",
    mlp_out="post_feedforward_layernorm",
)

LLAMA = Architecture("llama", _PRE_NORM, window=WindowRule.CAPS_CONTEXT)
# Qwen2 and Mistral: Llama's layer, with transformers' sliding-window masks.
LLAMA_SLIDING = Architecture("llama", _PRE_NORM)
OURO = Architecture(
    "ouro",
    NormNames(
        attention_in="input_layernorm",
        attention_out="input_layernorm_2",
        mlp_in="post_attention_layernorm",
        mlp_out="post_attention_layernorm_2",
    ),
    final_norm_every_loop=True,
    exit_gate=True,
    window=WindowRule.CAPS_CONTEXT,
)
QWEN3 = Architecture("qwen3", _PRE_NORM, qk_norm=QkNorm.PER_HEAD)
OLMO2 = Architecture(
    "olmo2",
    NormNames(
        attention_in=None,
        attention_out="post_attention_layernorm",
        mlp_in=None,
        mlp_out="post_feedforward_layernorm",
    ),
    qk_norm=QkNorm.WHOLE_PROJECTION,
    # transformers' OLMo 2 has no sliding window: a sliding_window key caps the context, as Llama.
    window=WindowRule.CAPS_CONTEXT,
)
PHI3 = Architecture("phi3", _PRE_NORM, fused_qkv=True, fused_gate_up=True)
GEMMA2 = Architecture("gemma2", _GEMMA_NORMS, norm_weight_offset=1.0, scale_embedding=True)
GEMMA3 = Architecture(
    "gemma3",
    _GEMMA_NORMS,
    qk_norm=QkNorm.PER_HEAD,
    norm_weight_offset=1.0,
    scale_embedding=True,
)
