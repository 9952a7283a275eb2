"""The ``config.json`` each GGUF architecture's metadata stands for, as transformers 5 writes
it for the model type (RoPE in ``rope_parameters``): the per-architecture builders that
:mod:`kvgate.executor.gguf_architectures` names, with the llama.cpp defaults a file may rely on.

Where a file leaves a setting to llama.cpp's defaults, the config states the value llama.cpp
would use (Gemma 2's soft-caps and window, Gemma 3's local RoPE base, the sliding-layer period,
Gemma's query scale): the model then computes what it computes under llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.gguf_metadata import GgufMetadata
from kvgate.executor.gguf_rope import llama3_parameters

# Reads one (small) tensor of the file as float32, by GGUF name.
TensorReader = Callable[[str], np.ndarray]
# (metadata, the file's tensor names, a reader) -> the config.json dictionary.
ConfigBuilder = Callable[[GgufMetadata, frozenset[str], TensorReader], dict[str, Any]]

# transformers' default θ when a config names none; llama.cpp's default for a missing freq_base.
_DEFAULT_THETA = 10000.0
# llama.cpp's defaults for keys Gemma files may omit (they equal transformers' Gemma 2 defaults).
_GEMMA2_DEFAULTS = {"sliding_window": 4096, "attn_softcap": 50.0, "final_softcap": 30.0}
_GEMMA_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
# The layer count of the 27B models, whose queries llama.cpp scales by hidden/heads (Gemma's
# reference code does too); every other size scales by head_dim.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _shape(meta: GgufMetadata, names: frozenset[str]) -> dict[str, Any]:
    """The keys every architecture shares: sizes, heads, norm epsilon, context, token ids."""
    hidden = meta.arch_int("embedding_length")
    num_heads = meta.arch_int("attention.head_count")
    head_dim = meta.arch_int("attention.key_length", hidden // num_heads)
    value_dim = meta.arch_int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{meta.path.name}: value heads of {value_dim} dims differ from key heads of "
            f"{head_dim}: not a layout transformers' {meta.architecture} has"
        )
    vocab = meta.arch_optional("vocab_size")
    if vocab is None:
        vocab = len(meta.require("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": meta.arch_int("feed_forward_length"),
        "num_hidden_layers": meta.arch_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.arch_int("attention.head_count_kv", num_heads),
        "rms_norm_eps": meta.arch_float("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.arch_int("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if meta.arch_optional("attention.key_length") is not None:
        # The converter writes it when the config states head_dim: state it back likewise.
        config["head_dim"] = head_dim
    rotary_dim = meta.arch_int("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        config["partial_rotary_factor"] = rotary_dim / head_dim
    for key in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return config


def _rope(meta: GgufMetadata, names: frozenset[str], read: TensorReader) -> dict[str, Any]:
    """``rope_parameters`` for the file's one RoPE (the global layers' for Gemma 3)."""
    theta = meta.arch_float("rope.freq_base", _DEFAULT_THETA)
    rotary_dim = meta.arch_int("rope.dimension_count", 0) or _head_dim(meta)
    kind = meta.arch_optional("rope.scaling.type")
    if "rope_freqs.weight" in names:
        if kind not in (None, "none"):
            raise CheckpointError(
                f"{meta.path.name}: rope_freqs.weight together with RoPE scaling {kind!r}"
            )
        scaling = llama3_parameters(read("rope_freqs.weight"), rotary_dim, theta, meta.path.name)
        if scaling is not None:
            return scaling.rope_parameters(theta)
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        return _longrope(meta, read, theta)
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": _scaling_factor(meta)}
    if kind == "yarn":
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": _scaling_factor(meta),
            "original_max_position_embeddings": meta.arch_int(
                "rope.scaling.original_context_length"
            ),
        }
        optional = {
            "rope.scaling.yarn_beta_fast": "beta_fast",
            "rope.scaling.yarn_beta_slow": "beta_slow",
            "rope.scaling.yarn_attn_factor": "attention_factor",
        }
        for key, name in optional.items():
            if meta.arch_optional(key) is not None:
                yarn[name] = meta.arch_float(key)
        return yarn
    raise CheckpointError(f"{meta.path.name}: RoPE scaling {kind!r} in a GGUF file: not supported")


def _head_dim(meta: GgufMetadata) -> int:
    hidden = meta.arch_int("embedding_length")
    return meta.arch_int("attention.key_length", hidden // meta.arch_int("attention.head_count"))


def _scaling_factor(meta: GgufMetadata) -> float:
    factor = meta.arch_float("rope.scaling.factor")
    if factor <= 0:
        raise CheckpointError(f"{meta.path.name}: rope.scaling.factor {factor} is not positive")
    return factor


def _longrope(meta: GgufMetadata, read: TensorReader, theta: float) -> dict[str, Any]:
    """Phi-3's LongRoPE: both factor lists, the original context, and the attention factor
    when it is not the one transformers derives from the two context lengths."""
    factors = {}
    for name in ("long", "short"):
        tensor = f"rope_factors_{name}.weight"
        try:
            factors[name] = [float(str(v)) for v in read(tensor).reshape(-1)]  # shortest form
        except KeyError as exc:
            raise CheckpointError(f"{meta.path.name}: LongRoPE needs {tensor} too") from exc
    original = meta.arch_int("rope.scaling.original_context_length")
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": theta,
        "long_factor": factors["long"],
        "short_factor": factors["short"],
        "original_max_position_embeddings": original,
    }
    scale = meta.arch_int("context_length") / original
    derived = np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0
    stated = meta.arch_optional("rope.scaling.attn_factor")
    if stated is not None and not np.isclose(float(stated), derived, rtol=1e-6):
        rope["attention_factor"] = float(stated)
    return rope


def _no_rope_scaling_keys(meta: GgufMetadata, rope: dict[str, Any]) -> None:
    """An attention factor only means something to LongRoPE and YaRN."""
    factor = meta.arch_optional("rope.scaling.attn_factor")
    if factor is not None and rope["rope_type"] != "longrope" and float(factor) != 1.0:
        raise CheckpointError(
            f"{meta.path.name}: rope.scaling.attn_factor {factor} with RoPE type "
            f"{rope['rope_type']!r}: kvgate knows no such combination"
        )


def dense_config(model_type: str, hf_class: str) -> ConfigBuilder:
    """llama, qwen2, qwen3: the shape, SiLU, one RoPE; the keys transformers writes for each:

    - llama: ``attention_bias`` (q, k, v and o biased, as the file's tensors say), ``mlp_bias``;
    - qwen2: q, k, v always biased (nothing to state); no window, every layer full attention;
    - qwen3: ``attention_bias`` as the file says; no window, every layer full attention.
    """

    def config(meta: GgufMetadata, names: frozenset[str], read: TensorReader) -> dict[str, Any]:
        rope = _rope(meta, names, read)
        _no_rope_scaling_keys(meta, rope)
        shape = _shape(meta, names)
        built = {
            "architectures": [hf_class],
            "model_type": model_type,
            **shape,
            "hidden_act": "silu",
            "rope_parameters": rope,
        }
        if model_type in ("llama", "qwen3"):
            built["attention_bias"] = "blk.0.attn_q.bias" in names
        if model_type == "llama":
            built["mlp_bias"] = False
        if model_type in ("qwen2", "qwen3"):
            built["use_sliding_window"] = False
            built["sliding_window"] = None
            built["layer_types"] = ["full_attention"] * shape["num_hidden_layers"]
        return built

    return config


def gemma_config(model_type: str, hf_class: str) -> ConfigBuilder:
    """gemma2, gemma3: GELU (tanh), offset norms, per-layer sliding windows and RoPE."""
    arch = "gemma2" if model_type == "gemma2" else "gemma3"

    def config(meta: GgufMetadata, names: frozenset[str], read: TensorReader) -> dict[str, Any]:
        shape = _shape(meta, names)
        full_rope = _rope(meta, names, read)
        _no_rope_scaling_keys(meta, full_rope)
        layers = shape["num_hidden_layers"]
        window = meta.arch_optional("attention.sliding_window")
        if window is None and arch == "gemma2":
            window = _GEMMA2_DEFAULTS["sliding_window"]
        sliding = _sliding_layers(meta, arch, layers) if window else [False] * layers
        # Gemma 2's local layers share the global RoPE unless the file says otherwise; Gemma
        # 3's run at 10,000 unscaled (llama.cpp's defaults, which match the published configs).
        local_theta = full_rope["rope_theta"] if arch == "gemma2" else _DEFAULT_THETA
        local_theta = meta.arch_float("rope.freq_base_swa", local_theta)
        local_rope = {"rope_type": "default", "rope_theta": local_theta}
        rope: dict[str, Any] = full_rope
        if arch == "gemma3" or local_rope != full_rope:
            rope = {"full_attention": full_rope, "sliding_attention": local_rope}
        heads = shape["num_attention_heads"]
        is_27b = layers == _GEMMA_27B_LAYERS[arch]
        built = {
            "architectures": [hf_class],
            "model_type": model_type,
            **shape,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": rope,
            "attention_bias": False,
            "query_pre_attn_scalar": shape["hidden_size"] // heads if is_27b else _head_dim(meta),
            "sliding_window": int(window) if window else None,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "final_logit_softcapping": _softcap(meta, "final_logit_softcapping", arch),
            "attn_logit_softcapping": _softcap(meta, "attn_logit_softcapping", arch),
        }
        return built

    return config


def _sliding_layers(meta: GgufMetadata, arch: str, layers: int) -> list[bool]:
    """Which layers slide: ``attention.sliding_window_pattern`` as a period (the last layer of
    each period is global, llama.cpp's rule and transformers') or as one flag per layer."""
    pattern = meta.arch_optional("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(
                f"{meta.path.name}: sliding_window_pattern has {len(pattern)} flags for "
                f"{layers} layers"
            )
        return [bool(flag) for flag in pattern]
    period = _GEMMA_SLIDING_PERIOD[arch] if pattern is None else int(pattern)
    if period == 0:  # llama.cpp: every layer slides
        return [True] * layers
    return [layer % period < period - 1 for layer in range(layers)]


def _softcap(meta: GgufMetadata, key: str, arch: str) -> float | None:
    """Gemma 2 always caps (llama.cpp's defaults when the key is absent); Gemma 3 only when the
    file says so, and never the attention logits."""
    value = meta.arch_optional(key)
    if arch == "gemma2" and value is None:
        value = _GEMMA2_DEFAULTS["attn_softcap" if key.startswith("attn") else "final_softcap"]
    return None if value is None or float(value) == 0.0 else float(value)


def phi3_config(meta: GgufMetadata, names: frozenset[str], read: TensorReader) -> dict[str, Any]:
    """phi3: fused projections, LongRoPE, an optional window (0: none, the converter's mark)."""
    rope = _rope(meta, names, read)
    _no_rope_scaling_keys(meta, rope)
    built: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        **_shape(meta, names),
        "hidden_act": "silu",
        "rope_parameters": rope,
    }
    original = meta.arch_optional("rope.scaling.original_context_length")
    if original is not None:
        built["original_max_position_embeddings"] = int(original)
    window = meta.arch_optional("attention.sliding_window")
    built["sliding_window"] = int(window) if window else None
    return built
