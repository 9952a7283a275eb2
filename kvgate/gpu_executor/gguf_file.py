"""Reading llama-architecture GGUF files: the configuration, the dequantized weights, the tokenizer.

A GGUF file is one self-describing container: key/value metadata (``llama.*`` for the shape,
``tokenizer.*`` for the vocabulary and the chat template) followed by tensors, each in its own
storage type (F32, F16, or a block quantization such as Q8_0 / Q4_1). gguf-py reads the container
and dequantizes the blocks; this module maps the result onto the Hugging Face layout the rest of
the executor speaks:

- tensor names: ``blk.N.attn_q`` → ``model.layers.N.self_attn.q_proj`` and so on
  (``_TENSOR_NAMES``);
- RoPE rows: llama.cpp's converter reorders each head's q/k rows from rotate-half order (the
  first halves of all rotary pairs, then the second halves) to interleaved pairs
  (``x0 y0 x1 y1 ...``); :func:`unpermute_rope_rows` restores rotate-half order. Skipping it
  gives a model that runs and writes fluent nonsense;
- tied embeddings: no ``output.weight`` tensor means the LM head is the embedding.

Weights come out as float32 numpy arrays: dequantizing Q4_1/Q8_0 is exact in float32 (each value
is ``d * q (+ m)`` with fp16 ``d`` and ``m``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.gpu_executor.config import CheckpointError

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (without ".weight") -> Hugging Face name (without ".weight"); {n} is the layer.
_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
}
# Tables some converters store; the executor recomputes them.
_IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf() -> Any:
    try:
        import gguf  # noqa: PLC0415 — optional: only GGUF models need it
    except ImportError as exc:
        raise CheckpointError(
            "reading .gguf files needs the 'gguf' package (pip install 'kvgate[executor]')"
        ) from exc
    return gguf


def supported_storage_types() -> tuple[str, ...]:
    """Names of the tensor storage types gguf-py can dequantize (F32, F16, BF16, Q8_0, ...)."""
    gguf = _gguf()
    kinds = gguf.GGMLQuantizationType
    dequantizable = {kinds.F32, kinds.F16, *gguf.quants._type_traits}
    return tuple(k.name for k in kinds if k in dequantizable)


@dataclass(frozen=True)
class GgufMetadata:
    """The metadata of one file: plain values by key (arrays as lists)."""

    path: Path
    values: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise CheckpointError(f"{self.path.name}: metadata key {key} is missing")
        return self.values[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


class GgufFile:
    """An open GGUF file (memory-mapped by gguf-py); tensors are dequantized on demand."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        gguf = _gguf()
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{self.path.name} is not a readable GGUF file: {exc}") from exc
        values: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            values[key] = field.contents()
        self.metadata = GgufMetadata(self.path, values)
        architecture = self.metadata.architecture
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path.name}: GGUF architecture {architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

    def hf_config(self) -> dict[str, Any]:
        """The file's shape as a Hugging Face ``config.json`` dictionary (``model_type`` llama)."""
        meta, arch = self.metadata, self.metadata.architecture
        hidden = int(meta.require(f"{arch}.embedding_length"))
        num_heads = int(meta.require(f"{arch}.attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise CheckpointError(
                f"{self.path.name}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported"
            )
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise CheckpointError(
                f"{self.path.name}: RoPE scaling {scaling!r} in a GGUF file is not supported"
            )
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.require("tokenizer.ggml.tokens"))
        names = {t.name for t in self._reader.tensors}
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        for key in ("bos", "eos", "padding"):
            token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None:
                config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
        return config

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array in HF orientation) for every weight in the file."""
        config = self.hf_config()
        heads = {
            "q_proj": config["num_attention_heads"],
            "k_proj": config["num_key_value_heads"],
        }
        for tensor in self._reader.tensors:
            if tensor.name in _IGNORED_TENSORS:
                continue
            name = hf_tensor_name(tensor.name)
            values = self._dequantize(tensor)
            projection = name.split(".")[-2]
            if projection in heads:
                values = unpermute_rope_rows(values, heads[projection])
            yield name, values

    def _dequantize(self, tensor: Any) -> np.ndarray:
        gguf = _gguf()
        kind = tensor.tensor_type
        if kind.name not in supported_storage_types():
            raise CheckpointError(
                f"{self.path.name}: tensor {tensor.name} is stored as {kind.name}, which cannot "
                f"be dequantized (supported: {', '.join(supported_storage_types())})"
            )
        values = gguf.quants.dequantize(tensor.data, kind)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.ascontiguousarray(values.reshape(shape), dtype=np.float32)
        # F32 tensors come back as views of the read-only memory map.
        return values if values.flags.writeable else values.copy()


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        raise CheckpointError(f"unexpected GGUF tensor name {gguf_name!r}")
    parts = stem.split(".")
    layer = None
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = parts[1]
        stem = ".".join(["blk", "{n}", *parts[2:]])
    hf = _TENSOR_NAMES.get(stem)
    if hf is None:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has no llama counterpart")
    return f"{hf.format(n=layer)}.{suffix}"


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
