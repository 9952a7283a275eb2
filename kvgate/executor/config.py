"""Model configuration: parsed once from a Hugging Face ``config.json``.

Two families share one set of layer primitives:

- ``llama`` — Llama / Qwen2 / Mistral (``model_type`` ``llama``, ``qwen2``, ``mistral``): RMSNorm,
  RoPE, GQA, SwiGLU MLP; one pass through the layers (``num_loops == 1``); the coda is the final
  norm followed by the LM head.
- ``looped`` — the Ouro layout (``model_type`` ``ouro``): the layer stack is a shared core run up to
  ``total_ut_steps`` times; each layer has a sandwich norm (``input_layernorm_2`` after attention,
  ``post_attention_layernorm_2`` after the MLP); the final norm runs at the end of *every* loop and
  its output both feeds the next loop and the exit gate ``model.early_exit_gate`` (a linear map to
  one logit); the coda is the LM head alone.

A key kvgate does not understand is an error, never a default: :mod:`config_keys` holds, per
model type, the keys read, the keys that cannot change the math, and the math keys served only at
their neutral value; :mod:`rope_config` reads RoPE from transformers 5's ``rope_parameters`` and
transformers 4's ``rope_theta`` / ``rope_scaling`` alike.

This module imports no torch: the configuration is plain data.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.executor.architecture import Activation, Architecture, WindowRule
from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.config_keys import MODEL_TYPES, ModelTypeKeys
from kvgate.executor.config_layers import context_length, read_layer_types, read_window
from kvgate.executor.moe_config import MoeConfig, read_moe
from kvgate.executor.rope_config import (
    DEFAULT_ROPE_THETA,
    LayerType,
    Rope,
    RopeScaling,
    RopeType,
    read_rope,
)
from kvgate.executor.weight_only import WeightOnly, WeightOnlyError, read_weight_only
from kvgate.protocol.enums import ModelFamily

# The config's parts are imported from here (their modules are how this one is built).
__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "CheckpointError",
    "LayerType",
    "ModelConfig",
    "Rope",
    "RopeScaling",
    "RopeType",
    "load_config",
    "parse_config",
]

log = logging.getLogger(__name__)

# Tokens per KV block unless the command line says otherwise (the cache's tensors are shaped by
# it; it sits here, with no torch, so `kvgate executor --help` shows it without importing torch).
DEFAULT_BLOCK_SIZE = 16


def _every_layer_type_default_rope() -> dict[LayerType, Rope]:
    return dict.fromkeys(LayerType, Rope(theta=DEFAULT_ROPE_THETA))


class ModelConfig(BaseModel):
    """Everything the executor needs to know about a model's shape."""

    model_config = ConfigDict(frozen=True)

    family: ModelFamily
    model_type: str
    vocab_size: Annotated[int, Field(ge=1)]
    hidden_size: Annotated[int, Field(ge=1)]
    intermediate_size: Annotated[int, Field(ge=1)]
    num_layers: Annotated[int, Field(ge=1)]
    num_heads: Annotated[int, Field(ge=1)]
    num_kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=2)]
    rms_norm_eps: Annotated[float, Field(gt=0.0)] = 1e-6
    # The RoPE of each layer type the config names (transformers 5 may give one per type).
    rope_by_layer_type: dict[LayerType, Rope] = Field(
        default_factory=_every_layer_type_default_rope
    )
    # Each layer's attention type; None: every layer is full attention.
    layer_types: tuple[LayerType, ...] | None = None
    # The window of the sliding layers (see layer_window); None: no layer slides.
    sliding_window: Annotated[int, Field(ge=1)] | None = None
    activation: Activation = Activation.SILU
    attn_logit_softcap: Annotated[float, Field(gt=0.0)] | None = None  # Gemma 2
    final_logit_softcap: Annotated[float, Field(gt=0.0)] | None = None  # Gemma 2
    query_pre_attn_scalar: Annotated[float, Field(gt=0.0)] | None = None  # Gemma: scores' scale
    max_position_embeddings: Annotated[int, Field(ge=1)] = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    num_loops: Annotated[int, Field(ge=1, le=64)] = 1
    eos_token_id: Annotated[int, Field(ge=0)] | None = None
    bos_token_id: Annotated[int, Field(ge=0)] | None = None
    torch_dtype: str | None = None
    moe: MoeConfig | None = None  # the experts of the sparse layers; None: a dense model
    # AWQ/GPTQ/FP8 projections (dequantized when read: weight_only.py); None: float weights
    weight_only: WeightOnly | None = None

    @model_validator(mode="after")
    def _every_layer_has_its_rope(self) -> ModelConfig:
        """Every layer type in use has a RoPE; where the model type applies one RoPE to every
        layer (all but Gemma 3), the layer types in use agree on it."""
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types lists {len(self.layer_types)} layers, num_hidden_layers is "
                f"{self.num_layers}"
            )
        types = tuple(dict.fromkeys(self.layer_types or (LayerType.FULL_ATTENTION,)))
        missing = sorted(t for t in types if t not in self.rope_by_layer_type)
        if missing:
            raise ValueError(f"no RoPE parameters for layer type(s) {', '.join(missing)}")
        ropes = {t: self.rope_by_layer_type[t] for t in types}
        one_rope = not MODEL_TYPES[self.model_type].rope_per_layer_type
        if one_rope and len(set(ropes.values())) > 1:
            each = "; ".join(f"{t}: {rope.describe()}" for t, rope in ropes.items())
            raise ValueError(
                f"the layer types use different RoPE ({each}); model_type {self.model_type} "
                "applies one RoPE to every layer"
            )
        return self

    @property
    def architecture(self) -> Architecture:
        """The layer recipe of this model type (see :mod:`kvgate.executor.architecture`)."""
        return MODEL_TYPES[self.model_type].architecture

    @property
    def softmax_scale(self) -> float:
        """Attention scores are ``(q . k) * softmax_scale``: ``1/√query_pre_attn_scalar`` for
        Gemma, ``1/√head_dim`` for every other family."""
        return float((self.query_pre_attn_scalar or self.head_dim) ** -0.5)

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[layer] if self.layer_types else LayerType.FULL_ATTENTION

    def layer_rope(self, layer: int) -> Rope:
        return self.rope_by_layer_type[self.layer_type(layer)]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal attention). A window as long as
        the served context never binds: None too, so that it costs no attention plan."""
        window = self.sliding_window
        if window is None or window >= self.max_position_embeddings:
            return None
        sliding = self.layer_type(layer) is LayerType.SLIDING_ATTENTION
        return window if sliding else None

    @property
    def rope(self) -> Rope:
        """The RoPE every layer applies (one, by the validator above)."""
        return self.layer_rope(0)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_scaling(self) -> RopeScaling:
        return self.rope.scaling

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face config dictionary onto :class:`ModelConfig` (raises CheckpointError).

    Phases: the model type's key table; the attention shape; every key reviewed against the
    table; RoPE from either layout; the layer types and the window; the typed config; one log
    line.
    """
    keys = _model_type_keys(raw.get("model_type"))
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(f"num_attention_heads {num_heads} not a multiple of {num_kv_heads}")
    review = keys.review(raw, head_dim)
    if review.refusals:
        raise CheckpointError("; ".join(review.refusals))
    rope = read_rope(raw, keys.rope, int(raw.get("max_position_embeddings", 4096)))
    layer_types = read_layer_types(raw, keys, int(raw["num_hidden_layers"]))
    ropes_used = [rope.by_layer_type[t] for t in set(layer_types) if t in rope.by_layer_type]
    per_layer = keys.architecture.window is WindowRule.PER_LAYER
    if keys.family is ModelFamily.LOOPED and "total_ut_steps" not in raw:
        raise CheckpointError("looped (ouro) config.json lacks total_ut_steps")
    attention_bias = bool(raw.get("attention_bias", False))
    try:
        config = ModelConfig(
            family=keys.family,
            model_type=keys.model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_by_layer_type=rope.by_layer_type,
            layer_types=layer_types,
            sliding_window=read_window(raw, keys) if per_layer else None,
            activation=_activation(raw, keys),
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            final_logit_softcap=raw.get("final_logit_softcapping"),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            max_position_embeddings=context_length(raw, keys, ropes_used),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(raw, keys.model_type, attention_bias),
            o_bias=attention_bias,  # every type with the key biases o too (qwen2 lacks it)
            moe=read_moe(raw, keys.model_type, int(raw["num_hidden_layers"])),
            num_loops=int(raw.get("total_ut_steps", 1)),
            eos_token_id=_first_int(raw.get("eos_token_id")),
            bos_token_id=_first_int(raw.get("bos_token_id")),
            torch_dtype=_dtype(raw),
            weight_only=_weight_only(raw),
        )
    except ValidationError as exc:
        raise CheckpointError(f"invalid config.json: {_reasons(exc)}") from exc
    defaulted = " (no RoPE key: transformers' default θ)"
    log.info(
        "model config: family %s (model_type %s), RoPE %s from %s%s; %s; neutral keys: %s",
        config.family,
        config.model_type,
        _describe_ropes(config),
        ", ".join(rope.layouts) or "no RoPE key",
        defaulted if rope.theta_defaulted else "",
        _describe_windows(config),
        ", ".join(review.neutral_seen) or "none",
    )
    _warn_past_the_original_context(config)
    return config


def _weight_only(raw: dict[str, Any]) -> WeightOnly | None:
    try:
        scheme = read_weight_only(raw)
    except WeightOnlyError as exc:
        raise CheckpointError(str(exc)) from None
    if scheme is not None and raw.get("num_local_experts", raw.get("num_experts")):
        raise CheckpointError(
            f"{scheme.describe()} in a mixture-of-experts model: kvgate reads quantized "
            "projections of dense layers only"
        )
    return scheme


def _describe_ropes(config: ModelConfig) -> str:
    """One RoPE, or each layer type's: what the load log shows."""
    used = dict.fromkeys(config.layer_type(i) for i in range(config.num_layers))
    ropes = {t: config.rope_by_layer_type[t] for t in used}
    if len(set(ropes.values())) == 1:
        return config.rope.describe()
    return "; ".join(f"{t.value}: {r.describe()}" for t, r in ropes.items())


def _describe_windows(config: ModelConfig) -> str:
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return f"full attention, context {config.max_model_len}"
    return (
        f"window {sliding[0]} on {len(sliding)} of {config.num_layers} layers, "
        f"context {config.max_model_len}"
    )


def _warn_past_the_original_context(config: ModelConfig) -> None:
    """LongRoPE and dynamic NTK past their original context are where kvgate departs from
    transformers (see :mod:`kvgate.executor.rope`): said once, at load, not discovered in the
    tokens."""
    for rope in dict.fromkeys(config.rope_by_layer_type.values()):
        scaling = rope.scaling
        original = scaling.original_max_position_embeddings
        if config.max_model_len <= original:
            continue
        if scaling.rope_type is RopeType.LONGROPE:
            log.warning(
                "LongRoPE: positions from %d on rotate with the long factors, each by its own "
                "position (a cached key never changes); transformers' generate() re-rotates a "
                "whole sequence with them once it passes %d positions, so outputs past that "
                "point can differ from transformers'",
                original,
                original,
            )
        elif scaling.rope_type is RopeType.DYNAMIC:
            log.warning(
                "dynamic NTK: position p from %d on rotates with the θ of a sequence of p + 1 "
                "(a cached key never changes); transformers rotates a whole call with the θ of "
                "its length, so a prompt longer than %d can give other outputs than "
                "transformers'",
                original,
                original,
            )


def _reasons(exc: ValidationError) -> str:
    """Each failed check as ``field: message`` (a model-wide check has no field)."""
    reasons = []
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        field = ".".join(str(part) for part in error["loc"])
        reasons.append(f"{field}: {message}" if field else message)
    return "; ".join(reasons)


def _model_type_keys(model_type: Any) -> ModelTypeKeys:
    keys = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if keys is None:
        known = ", ".join(sorted(MODEL_TYPES))
        raise CheckpointError(f"unsupported model_type {model_type!r} (supported: {known})")
    return keys


def _qkv_bias(raw: dict[str, Any], model_type: str, attention_bias: bool) -> bool:
    """Qwen2 always biases q, k and v; Qwen2-MoE by ``qkv_bias`` (transformers' default true);
    the others by ``attention_bias``."""
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return model_type == "qwen2" or attention_bias


def _activation(raw: dict[str, Any], keys: ModelTypeKeys) -> Activation:
    """The MLP's activation: Gemma's ``hidden_activation``, everyone else's ``hidden_act``."""
    key = "hidden_activation" if "hidden_activation" in keys.used else "hidden_act"
    name = raw.get(key, "gelu_pytorch_tanh" if key == "hidden_activation" else "silu")
    if name not in {a.value for a in Activation}:
        served = ", ".join(a.value for a in Activation)
        raise CheckpointError(f"unsupported {key}={name!r}: kvgate runs {served}")
    return Activation(name)


def _dtype(raw: dict[str, Any]) -> str | None:
    """The weights' dtype: ``dtype`` (transformers 5) or ``torch_dtype`` (transformers 4)."""
    new, old = raw.get("dtype"), raw.get("torch_dtype")
    if new is not None and old is not None and new != old:
        raise CheckpointError(f"config.json has dtype {new!r} but torch_dtype {old!r}")
    return new if new is not None else old


def _first_int(value: Any) -> int | None:
    """``eos_token_id`` may be an int or a list of ints; the first one ends a sequence."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return parse_config(raw)
