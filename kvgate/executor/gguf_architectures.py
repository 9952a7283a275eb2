"""What each GGUF architecture means in Hugging Face terms: tensor names and config keys.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames every tensor (``blk.N.attn_q`` for
``model.layers.N.self_attn.q_proj``), moves the config into ``{arch}.*`` metadata keys, and
rewrites some tensors on the way; reading a file back means undoing each of those steps:

============  =====================================================================================
``llama``     q/k rows (and biases) reordered from rotate-half to interleaved RoPE pairs, per
              head (:func:`unpermute_rope_rows`); Llama 3's RoPE scaling as ``rope_freqs.weight``
``qwen2``     q/k/v biases; rows in rotate-half order already (llama.cpp runs it NeoX-style)
``qwen3``     ``attn_q_norm`` / ``attn_k_norm`` (QK-norm); no biases
``gemma2``    every norm stored as ``w + 1`` (Gemma's RMSNorm scales by ``1 + w``), four norms
              a layer, no LM head (tied); soft-caps and the window as metadata; every other
              layer slides; queries scaled by ``query_pre_attn_scalar``, which the file does not
              store: llama.cpp derives it from the layer count (below), and so does this module
``gemma3``    as gemma2 plus QK-norm (``+ 1`` too); five sliding layers to one global; the
              sliding layers' RoPE base is ``rope.freq_base_swa`` (10,000 when absent), linear
              scaling applies to the global layers only
``phi3``      fused ``attn_qkv`` (q, k, v rows) and ``ffn_up`` holding gate then up
              (``gate_up_proj``); LongRoPE as ``rope_factors_long`` / ``rope_factors_short``
============  =====================================================================================

The config (built in :mod:`kvgate.executor.gguf_config`) is written as transformers 5 writes
``config.json`` for the model type (RoPE in ``rope_parameters``), so
:func:`kvgate.executor.config.parse_config` judges it exactly as it judges a checkpoint from the
Hub: a model type or feature the executor does not run is refused
there, by name. Every ``{arch}.*`` metadata key must be one this module reads or knows to be
harmless: an unread key may change the math (the rule of :mod:`kvgate.executor.config_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.gguf_config import ConfigBuilder, dense_config, gemma_config, phi3_config
from kvgate.executor.gguf_metadata import GgufMetadata

_COMMON_KEYS = frozenset(
    {
        "context_length",
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "vocab_size",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "attention.layer_norm_rms_epsilon",
        "rope.dimension_count",
        "rope.freq_base",
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scaling.original_context_length",
        "rope.scaling.attn_factor",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.finetuned",  # informational: llama.cpp reads it and computes nothing from it
    }
)
_GEMMA_KEYS = frozenset(
    {
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        "final_logit_softcapping",
    }
)

_LLAMA_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
}
_QK_NORM_TENSORS = {
    "blk.{n}.attn_q_norm": "model.layers.{n}.self_attn.q_norm",
    "blk.{n}.attn_k_norm": "model.layers.{n}.self_attn.k_norm",
}
_GEMMA_TENSORS = _LLAMA_TENSORS | {
    "blk.{n}.post_attention_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.pre_feedforward_layernorm",
    "blk.{n}.post_ffw_norm": "model.layers.{n}.post_feedforward_layernorm",
}
_PHI3_TENSORS = {
    name: hf
    for name, hf in _LLAMA_TENSORS.items()
    if name.rpartition(".")[2] not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
} | {
    "blk.{n}.attn_qkv": "model.layers.{n}.self_attn.qkv_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.gate_up_proj",  # [2 * ffn, hidden]: gate, then up
}


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture`` value and how to read its files."""

    name: str
    model_type: str
    hf_class: str
    tensors: Mapping[str, str]  # GGUF stem -> HF stem ({n}: the layer), without .weight/.bias
    rope_tensors: tuple[str, ...]  # consumed by the config, never served as weights
    metadata_keys: frozenset[str]  # the ``{arch}.*`` keys this module reads (arch prefix off)
    config: ConfigBuilder
    # llama.cpp's converter interleaved the RoPE pairs of q/k rows (llama-style RoPE).
    rope_rows_interleaved: bool = False
    # Norm weights stored as ``w + offset`` (Gemma: 1); the reader subtracts it.
    norm_offset: float = 0.0

    def hf_name(self, gguf_name: str) -> str:
        """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``."""
        stem, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            raise CheckpointError(f"unexpected GGUF tensor name {gguf_name!r}")
        parts = stem.split(".")
        layer = None
        if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
            layer = parts[1]
            stem = ".".join(["blk", "{n}", *parts[2:]])
        hf = self.tensors.get(stem)
        if hf is None:
            raise CheckpointError(f"GGUF tensor {gguf_name!r} has no {self.name} counterpart")
        return f"{hf.format(n=layer)}.{suffix}"

    def restore(self, hf_name: str, values: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
        """Undo what the converter did to one tensor (``values`` float32, HF orientation)."""
        module = hf_name.split(".")[-2]
        if self.rope_rows_interleaved and module in ("q_proj", "k_proj"):
            heads = config["num_attention_heads" if module == "q_proj" else "num_key_value_heads"]
            return unpermute_rope_rows(values, int(heads))
        if self.norm_offset and module.endswith("norm"):
            # Exact: a stored w + 1 in [0.5, 2] minus 1 is representable (Sterbenz), so
            # (1 + restored) is the stored value, bit for bit, and so is Gemma's (1 + w) scale.
            return values - np.float32(self.norm_offset)
        return values


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """q/k projection rows from GGUF's interleaved-pair order back to rotate-half order.

    Per head of ``D`` rows, GGUF stores row ``2 i + j`` for element ``j`` of rotary pair ``i``;
    rotate-half stores it at ``j D/2 + i``::

        GGUF:         x0 y0 x1 y1 ... x(D/2-1) y(D/2-1)
        rotate-half:  x0 x1 ... x(D/2-1) y0 y1 ... y(D/2-1)

    ``weight`` is ``[num_heads * D, ...]`` (a bias is ``[num_heads * D]``).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(f"{rows} projection rows do not split into {num_heads} RoPE heads")
    half = rows // num_heads // 2
    by_pair = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(by_pair.swapaxes(1, 2).reshape(weight.shape))


ARCHITECTURES: Mapping[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            "llama",
            "llama",
            "LlamaForCausalLM",
            _LLAMA_TENSORS,
            ("rope_freqs.weight",),
            _COMMON_KEYS,
            dense_config("llama", "LlamaForCausalLM"),
            rope_rows_interleaved=True,
        ),
        Architecture(
            "qwen2",
            "qwen2",
            "Qwen2ForCausalLM",
            _LLAMA_TENSORS,
            ("rope_freqs.weight",),
            _COMMON_KEYS,
            dense_config("qwen2", "Qwen2ForCausalLM"),
        ),
        Architecture(
            "qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            _LLAMA_TENSORS | _QK_NORM_TENSORS,
            ("rope_freqs.weight",),
            _COMMON_KEYS,
            dense_config("qwen3", "Qwen3ForCausalLM"),
        ),
        Architecture(
            "gemma2",
            "gemma2",
            "Gemma2ForCausalLM",
            _GEMMA_TENSORS,
            (),
            _COMMON_KEYS | _GEMMA_KEYS | {"attn_logit_softcapping"},
            gemma_config("gemma2", "Gemma2ForCausalLM"),
            norm_offset=1.0,
        ),
        Architecture(
            "gemma3",
            "gemma3_text",
            "Gemma3ForCausalLM",
            _GEMMA_TENSORS | _QK_NORM_TENSORS,
            (),
            _COMMON_KEYS | _GEMMA_KEYS,
            gemma_config("gemma3_text", "Gemma3ForCausalLM"),
            norm_offset=1.0,
        ),
        Architecture(
            "phi3",
            "phi3",
            "Phi3ForCausalLM",
            _PHI3_TENSORS,
            ("rope_factors_long.weight", "rope_factors_short.weight"),
            _COMMON_KEYS | {"attention.sliding_window"},
            phi3_config,
        ),
    )
}


def architecture_of(meta: GgufMetadata) -> Architecture:
    """The file's architecture, once every ``{arch}.*`` key is one it reads (else refused)."""
    name = meta.architecture
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise CheckpointError(
            f"{meta.path.name}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    prefix = f"{name}."
    unknown = sorted(
        key
        for key in meta.values
        if key.startswith(prefix) and key.removeprefix(prefix) not in arch.metadata_keys
    )
    if unknown:
        raise CheckpointError(
            f"{meta.path.name}: metadata {', '.join(unknown)} not understood for a {name} "
            "file; kvgate refuses keys that may change the computation rather than skip them"
        )
    if any(key.startswith("split.") for key in meta.values):
        raise CheckpointError(
            f"{meta.path.name} is one part of a split GGUF file: merge the parts first "
            "(llama.cpp's gguf-split --merge)"
        )
    return arch
