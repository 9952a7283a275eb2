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

This module imports no torch: the configuration is plain data.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.protocol.enums import ModelFamily

# Tokens per KV block unless the command line says otherwise (the cache's tensors are shaped by
# it; it sits here, with no torch, so `kvgate executor --help` shows it without importing torch).
DEFAULT_BLOCK_SIZE = 16


class CheckpointError(ValueError):
    """A model directory that cannot be served, with the reason in the message."""


class RopeType(StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


_LLAMA_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
_LOOPED_MODEL_TYPES = frozenset({"ouro"})


class RopeScaling(BaseModel):
    """RoPE frequency scaling (``rope_scaling`` in config.json)."""

    model_config = ConfigDict(frozen=True)

    rope_type: RopeType = RopeType.DEFAULT
    factor: Annotated[float, Field(gt=0.0)] = 1.0
    low_freq_factor: Annotated[float, Field(gt=0.0)] = 1.0
    high_freq_factor: Annotated[float, Field(gt=0.0)] = 4.0
    original_max_position_embeddings: Annotated[int, Field(ge=1)] = 8192


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
    rope_theta: Annotated[float, Field(gt=0.0)] = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: Annotated[int, Field(ge=1)] = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    num_loops: Annotated[int, Field(ge=1, le=64)] = 1
    eos_token_id: Annotated[int, Field(ge=0)] | None = None
    bos_token_id: Annotated[int, Field(ge=0)] | None = None
    torch_dtype: str | None = None

    @property
    def sandwich_norm(self) -> bool:
        """Ouro layers normalize the attention and MLP outputs before the residual add."""
        return self.family is ModelFamily.LOOPED

    @property
    def norm_every_loop(self) -> bool:
        """Ouro applies the final norm after each loop; Llama applies it once, in the coda."""
        return self.family is ModelFamily.LOOPED

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings


def _first_int(value: Any) -> int | None:
    """``eos_token_id`` may be an int or a list of ints; the first one ends a sequence."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _rope_scaling(raw: Any) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise CheckpointError(f"rope_scaling must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind not in {t.value for t in RopeType}:
        supported = ", ".join(t.value for t in RopeType)
        raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: {supported})")
    fields = {k: v for k, v in raw.items() if k in RopeScaling.model_fields and k != "rope_type"}
    return RopeScaling(rope_type=RopeType(kind), **fields)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face config dictionary onto :class:`ModelConfig` (raises CheckpointError)."""
    model_type = raw.get("model_type")
    if model_type in _LLAMA_MODEL_TYPES:
        family = ModelFamily.LLAMA
    elif model_type in _LOOPED_MODEL_TYPES:
        family = ModelFamily.LOOPED
    else:
        known = ", ".join(sorted(_LLAMA_MODEL_TYPES | _LOOPED_MODEL_TYPES))
        raise CheckpointError(f"unsupported model_type {model_type!r} (supported: {known})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported hidden_act {act!r}: only the SwiGLU MLP (silu)")
    if raw.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor other than 1.0 is not supported")
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [k for k in required if k not in raw]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(f"num_attention_heads {num_heads} not a multiple of {num_kv_heads}")
    max_positions = int(raw.get("max_position_embeddings", 4096))
    # A sliding window as long as the context is plain causal attention; cap the context there.
    window = raw.get("sliding_window")
    if window is not None and (model_type != "qwen2" or raw.get("use_sliding_window")):
        max_positions = min(max_positions, int(window))
    if family is ModelFamily.LOOPED and "total_ut_steps" not in raw:
        raise CheckpointError("looped (ouro) config.json lacks total_ut_steps")
    try:
        return ModelConfig(
            family=family,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling(raw.get("rope_scaling")),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
            num_loops=int(raw.get("total_ut_steps", 1)),
            eos_token_id=_first_int(raw.get("eos_token_id")),
            bos_token_id=_first_int(raw.get("bos_token_id")),
            torch_dtype=raw.get("torch_dtype"),
        )
    except ValidationError as exc:
        raise CheckpointError(f"invalid config.json: {exc}") from exc


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
