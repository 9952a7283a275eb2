"""The ``config.json`` keys kvgate understands, model type by model type: the table a reviewer
reads and extends when a family or a transformers version arrives.

Every key of a config is in one of three tables of its model type:

- **used** — :func:`kvgate.executor.config.parse_config` reads it into ``ModelConfig``;
- **ignored** — it cannot change the forward pass (what wrote the file, switches of transformers'
  own runtime, training settings); each entry says why;
- **neutral** — it changes the math, and kvgate runs only the value at which it changes nothing
  (``mlp_bias`` false, ``partial_rotary_factor`` 1, no soft-capping, …).

Any other key is refused, and so is a neutral key at another value: the refusal names the key
and its value.

Why refuse a key nobody reviewed rather than skip it. transformers and vLLM read the keys their
model code asks for and skip the rest, which is sound when the reader and the writer are the same
library at the same version. kvgate reads files written by other libraries and other versions;
from a key's name alone it cannot tell metadata from math. Skipping is how transformers 5's
``rope_parameters`` went unread: a Llama 3 checkpoint ran with θ = 10,000 and no llama3 scaling,
and every request completed with wrong tokens. A refusal costs a one-line review (add the key to
``ignored`` with its reason, or implement it); a skipped math key costs every answer, silently.
So the tables are explicit per model type, like vLLM's registry of architectures, and reviewed
when a family is added; keys transformers adds over versions are refused until someone has
read what they do. ``tests/executor/test_config_layouts.py`` saves each supported type's config
with the installed transformers and parses it, so an upgrade that adds a key fails in CI first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvgate.executor.architecture import (
    GEMMA2,
    GEMMA3,
    LLAMA,
    LLAMA_SLIDING,
    OLMO2,
    OURO,
    PHI3,
    QWEN3,
    Architecture,
)
from kvgate.executor.rope_config import LayerType, RopeRules, RopeType
from kvgate.protocol.enums import ModelFamily


@dataclass(frozen=True)
class Neutral:
    """A key that changes the math; kvgate serves it only where it changes nothing."""

    served: str  # the value(s) kvgate runs, as a refusal shows them
    accepts: Callable[[Any, int], bool]  # (value, head_dim) -> it has no effect


def _only(served: str, *values: object) -> Neutral:
    return Neutral(served, lambda value, head_dim: any(value == v for v in values))


def _head_dim_scale(value: Any, head_dim: int) -> bool:
    # Queries scaled by query_pre_attn_scalar ** -0.5: the usual head_dim ** -0.5 when equal.
    return value is None or value == head_dim


_COMMON_USED = frozenset(
    {
        "model_type",
        "quantization_config",  # weight-only AWQ/GPTQ/FP8: kvgate/executor/weight_only.py
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",  # transformers 4's name
        "dtype",  # transformers 5's name
        "rope_parameters",  # transformers 5's RoPE layout
        "rope_theta",  # transformers 4's RoPE layout
        "rope_scaling",  # transformers 4's RoPE layout
        "sliding_window",  # the window of sliding layers (or the context cap: see WindowRule)
        "layer_types",
    }
)

_COMMON_IGNORED: dict[str, str] = {
    "architectures": "the class transformers would build; model_type decides here",
    "_name_or_path": "where transformers loaded the file from",
    "transformers_version": "the version that wrote the file",
    "auto_map": "transformers' remote-code class paths",
    "is_llama_config": "a converter's marker (SmolLM2's nanotron export)",
    "transformers.js_config": "settings of transformers.js",
    "id2label": "labels of classification heads, not of a causal LM",
    "label2id": "labels of classification heads, not of a causal LM",
    "problem_type": "the loss of classification heads",
    "use_cache": "transformers' own KV-cache switch; kvgate always caches",
    "output_attentions": "what transformers' forward returns besides the logits",
    "output_hidden_states": "what transformers' forward returns besides the logits",
    "return_dict": "the type transformers' forward returns",
    "chunk_size_feed_forward": "runs the MLP over positions in chunks: the same numbers",
    "initializer_range": "the initialization of training; the weights are given",
    "attention_dropout": "dropout acts only in training; transformers' eval forward skips it too",
    "pretraining_tp": (
        "transformers 4 cut the projections into this many slices and summed them (the same "
        "math in another summation order); transformers 5 no longer reads it"
    ),
    "pad_token_id": "pads batched transformers inputs; kvgate never pads a sequence",
}

_COMMON_NEUTRAL: dict[str, Neutral] = {
    "hidden_act": _only("'silu' (the SwiGLU MLP)", "silu"),
    "mlp_bias": _only("false (no MLP biases)", False),
    "partial_rotary_factor": _only("1 (RoPE on whole heads)", 1),
    "rope_interleaved": _only("false (rotate-half RoPE)", False),
    "attn_logit_softcapping": _only("null (no attention soft-capping)", None),
    "final_logit_softcapping": _only("null (no logit soft-capping)", None),
    "query_pre_attn_scalar": Neutral(
        "null or head_dim (queries scaled by 1/√head_dim)", _head_dim_scale
    ),
    "use_bidirectional_attention": _only("false (causal attention)", False, None),
    "is_encoder_decoder": _only("false (a decoder-only model)", False),
}

_WINDOW_LAYERS = (
    "which layers slide under use_sliding_window: with the context capped at the window, or "
    "use_sliding_window refused, it changes nothing"
)


# Mixture of experts: kvgate/executor/moe_config.py reads the expert keys (transformers maps
# num_experts onto num_local_experts for mixtral and qwen3_moe; qwen2_moe knows num_experts only).
_MOE_USED = {"num_experts", "num_local_experts", "num_experts_per_tok"}
_QWEN_MOE_USED = {
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "use_sliding_window",
}
_MOE_TRAINING: dict[str, str] = {
    "router_aux_loss_coef": "the weight of the load-balancing loss, a training term",
    "output_router_logits": "whether transformers' forward also returns the router logits",
}


class LayerTypeRule(StrEnum):
    """Which layers slide when a config has no ``layer_types`` (transformers' rule per type)."""

    ALL_SLIDING = "all_sliding"  # every layer, when sliding_window is set (Mistral, Phi-3)
    QWEN = "qwen"  # with use_sliding_window, layers from max_window_layers on (Qwen2, Qwen3)
    ALTERNATING = "alternating"  # even layers slide, odd ones are global (Gemma 2)
    PATTERN = "pattern"  # every sliding_window_pattern-th layer is global (Gemma 3, default 6)


@dataclass(frozen=True)
class KeyReview:
    refusals: tuple[str, ...]  # one line per key kvgate cannot serve as written
    neutral_seen: tuple[str, ...]  # ``key=value`` of every neutral key present


@dataclass(frozen=True)
class ModelTypeKeys:
    """The keys of one ``model_type``, the family that runs it and its layer recipe."""

    model_type: str
    family: ModelFamily
    architecture: Architecture
    used: frozenset[str]
    ignored: Mapping[str, str]  # key -> why the forward pass never depends on it
    neutral: Mapping[str, Neutral]
    rope: RopeRules = field(default_factory=RopeRules)
    layer_types: LayerTypeRule = LayerTypeRule.ALL_SLIDING
    # Whether layers of different types may rotate differently (Gemma 3's local and global
    # RoPE); elsewhere transformers builds one rotary embedding for every layer.
    rope_per_layer_type: bool = False

    def review(self, raw: Mapping[str, Any], head_dim: int) -> KeyReview:
        """Each key of ``raw``: used, ignored, neutral at its neutral value, or refused."""
        refusals: list[str] = []
        neutral_seen: list[str] = []
        for key, value in raw.items():
            if key in self.used or key in self.ignored:
                continue
            neutral = self.neutral.get(key)
            if neutral is None:
                refusals.append(
                    f"unknown config key {key}={_short(value)} (model_type {self.model_type}): "
                    "kvgate cannot tell whether it changes the math (if it does not, list it "
                    "among the ignored keys in kvgate/executor/config_keys.py)"
                )
            elif neutral.accepts(value, head_dim):
                neutral_seen.append(f"{key}={_short(value)}")
            else:
                refusals.append(
                    f"unsupported {key}={_short(value)} (model_type {self.model_type}): "
                    f"kvgate runs only {neutral.served}"
                )
        return KeyReview(tuple(refusals), tuple(neutral_seen))


def _keys(
    model_type: str,
    family: ModelFamily,
    architecture: Architecture,
    used: set[str] | None = None,
    ignored: dict[str, str] | None = None,
    neutral: dict[str, Neutral] | None = None,
    *,
    rope: RopeRules | None = None,
    layer_types: LayerTypeRule | None = None,
    rope_per_layer_type: bool = False,
) -> ModelTypeKeys:
    """The common tables with this type's own: a key it uses or ignores leaves the common
    neutral table (Gemma reads ``query_pre_attn_scalar``; others serve it only at head_dim).

    A type that reads ``use_sliding_window`` slides the Qwen way unless told otherwise."""
    used_keys = _COMMON_USED | (used or set())
    ignored_keys = _COMMON_IGNORED | (ignored or {})
    common_neutral = {
        k: v for k, v in _COMMON_NEUTRAL.items() if k not in used_keys and k not in ignored_keys
    }
    return ModelTypeKeys(
        model_type,
        family,
        architecture,
        used_keys,
        ignored_keys,
        common_neutral | (neutral or {}),
        rope or RopeRules(),
        layer_types
        or (LayerTypeRule.QWEN if "use_sliding_window" in used_keys else LayerTypeRule.ALL_SLIDING),
        rope_per_layer_type,
    )


_MOE_TYPES = (
    _keys(
        "mixtral",
        ModelFamily.LLAMA,
        LLAMA_SLIDING,
        used=_MOE_USED,
        ignored=_MOE_TRAINING
        | {
            "router_jitter_noise": (
                "noise on the router's input in training only (MixtralSparseMoeBlock applies "
                "it when self.training)"
            ),
        },
    ),
    # attention_bias: biases on q, k, v and o; q_norm and k_norm on every head (as qwen3).
    _keys(
        "qwen3_moe",
        ModelFamily.LLAMA,
        QWEN3,
        used=_QWEN_MOE_USED | {"num_local_experts", "attention_bias"},
        ignored=_MOE_TRAINING
        | {
            "max_window_layers": (
                "published Qwen3-MoE configs carry it; transformers' qwen3_moe code never reads it"
            ),
        },
    ),
    # qkv_bias: biases on q, k and v (o has none); a sigmoid-gated shared expert.
    _keys(
        "qwen2_moe",
        ModelFamily.LLAMA,
        LLAMA_SLIDING,
        used=_QWEN_MOE_USED | {"qkv_bias", "shared_expert_intermediate_size"},
        ignored=_MOE_TRAINING | {"max_window_layers": _WINDOW_LAYERS},
    ),
)

_GEMMA_USED = {
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention_bias",
}
_GEMMA_IGNORED = {
    "hidden_act": "Gemma's MLP reads hidden_activation (transformers ignores hidden_act for it)",
    "cache_implementation": "the KV-cache class transformers' generate() builds",
}

_FAMILIES = (
    # Qwen3: Llama with an RMSNorm on every query and key head; attention_bias: q, k, v, o.
    _keys(
        "qwen3",
        ModelFamily.LLAMA,
        QWEN3,
        used={"attention_bias", "use_sliding_window", "max_window_layers"},
    ),
    # OLMo 2: norms after attention and MLP (none before), QK-norm over the whole projection.
    _keys("olmo2", ModelFamily.LLAMA, OLMO2, used={"attention_bias"}),
    # Phi-3: fused qkv_proj and gate_up_proj, LongRoPE; every layer slides when
    # sliding_window is set.
    _keys(
        "phi3",
        ModelFamily.LLAMA,
        PHI3,
        used={"original_max_position_embeddings"},
        ignored={
            "embd_pdrop": "dropout on the embeddings, in training only",
            "resid_pdrop": "dropout on the residual branches, in training only",
        },
        neutral={"attention_bias": _only("false (Phi-3 has no attention biases)", False)},
        rope=RopeRules(
            top_level_original_context=4096,
            type_aliases={"su": RopeType.LONGROPE, "yarn": RopeType.LONGROPE},
            types=frozenset({RopeType.DEFAULT, RopeType.LONGROPE}),
        ),
    ),
    # Gemma 2: (1 + w) norms around attention and MLP, √H embeddings, GELU, soft-caps,
    # alternating sliding and global layers, one RoPE.
    _keys(
        "gemma2",
        ModelFamily.LLAMA,
        GEMMA2,
        used=_GEMMA_USED,
        ignored=_GEMMA_IGNORED,
        layer_types=LayerTypeRule.ALTERNATING,
    ),
    # Gemma 3 (text): Gemma 2's layer with QK-norm; local layers have their own RoPE.
    _keys(
        "gemma3_text",
        ModelFamily.LLAMA,
        GEMMA3,
        used=_GEMMA_USED | {"rope_local_base_freq", "sliding_window_pattern"},
        ignored=_GEMMA_IGNORED
        | {
            "_sliding_window_pattern": (
                "transformers writes it and never reads it back (layer_types decide, or "
                "sliding_window_pattern without them)"
            ),
        },
        rope=RopeRules(
            default_theta={LayerType.FULL_ATTENTION: 1e6, LayerType.SLIDING_ATTENTION: 1e4},
            legacy_theta_key={LayerType.SLIDING_ATTENTION: "rope_local_base_freq"},
            legacy_scaling_layers=frozenset({LayerType.FULL_ATTENTION}),
            per_layer_type=True,
        ),
        layer_types=LayerTypeRule.PATTERN,
        rope_per_layer_type=True,
    ),
)

MODEL_TYPES: Mapping[str, ModelTypeKeys] = {
    keys.model_type: keys
    for keys in (
        # attention_bias: biases on q, k, v and o.
        _keys("llama", ModelFamily.LLAMA, LLAMA, used={"attention_bias"}),
        # q, k, v always biased; use_sliding_window switches sliding_window on for the layers
        # from max_window_layers on.
        _keys(
            "qwen2",
            ModelFamily.LLAMA,
            LLAMA_SLIDING,
            used={"use_sliding_window", "max_window_layers"},
        ),
        # sliding_window slides every layer.
        _keys("mistral", ModelFamily.LLAMA, LLAMA_SLIDING),
        *_FAMILIES,
        *_MOE_TYPES,
        _keys(
            "ouro",
            ModelFamily.LOOPED,
            OURO,
            used={"total_ut_steps"},
            ignored={
                "max_window_layers": _WINDOW_LAYERS,
                "use_sliding_window": "any sliding_window caps the context, switched on or not",
                "early_exit_threshold": (
                    "transformers' exit rule; kvgate's is the executor's --exit-policy and each "
                    "request's exit_threshold"
                ),
            },
            neutral={"attention_bias": _only("false (Ouro layers carry no biases)", False)},
        ),
    )
}


def _short(value: Any) -> str:
    """The value as config.json spells it, cut at 60 characters."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."
