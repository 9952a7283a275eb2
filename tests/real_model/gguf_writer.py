"""Small GGUF files written with gguf-py's writer, laid out as llama.cpp's converter does.

Written from the converter's conventions, independently of kvgate's reader:

- tensor names from gguf-py's own ``TensorNameMap`` (the table the converter uses);
- llama: q/k rows (and biases) reordered from rotate-half to interleaved pairs per head;
  Llama 3's RoPE scaling as ``rope_freqs.weight``, the divisor of each frequency;
- gemma2/gemma3: every ``*norm.weight`` stored as ``w + 1``, no ``output`` (tied), and the
  metadata keys the converter writes (soft-caps, window, the local RoPE base);
- phi3: fused ``qkv_proj`` / ``gate_up_proj`` under ``attn_qkv`` / ``ffn_up``, LongRoPE as
  ``rope_factors_long`` / ``rope_factors_short`` with the original context and attention factor.

A vocabulary (:class:`Vocabulary`) is written as the converter writes one; by default every
token is one byte (a byte-level BPE vocabulary without merges).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kvgate.executor.tokenizer import BOS_TOKEN, EOS_TOKEN, _byte_to_char

CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
Q = gguf.GGMLQuantizationType
# transformers' model_type -> llama.cpp's architecture (Mistral converts as llama).
GGUF_ARCHITECTURE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
_GEMMA = ("gemma2", "gemma3")


@dataclass
class Vocabulary:
    """A ``tokenizer.*`` section as the converter writes it."""

    model: str  # tokenizer.ggml.model: gpt2 or llama
    tokens: list[str]
    types: list[int]
    pre: str | None = None
    merges: list[str] | None = None
    scores: list[float] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unknown_id: int | None = None
    padding_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # any other tokenizer.ggml.* key


def byte_vocabulary(vocab_size: int, model: str = "gpt2") -> Vocabulary:
    """256 byte tokens, BOS, EOS and padding up to ``vocab_size``; no merges."""
    chars = _byte_to_char()
    tokens = [chars[b] for b in range(256)] + [BOS_TOKEN, EOS_TOKEN]
    tokens += [f"<|pad{i}|>" for i in range(vocab_size - len(tokens))]
    types = [1] * 256 + [3, 3] + [4] * (len(tokens) - 258)
    return Vocabulary(
        model=model,
        tokens=tokens,
        types=types,
        pre="default",
        merges=[],
        bos_id=256,
        eos_id=257,
        chat_template=CHAT_TEMPLATE,
    )


def write_vocabulary(writer: gguf.GGUFWriter, vocabulary: Vocabulary) -> None:
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.pre is not None:
        writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    if vocabulary.scores is not None:
        writer.add_token_scores(vocabulary.scores)
    if vocabulary.merges is not None:
        writer.add_token_merges(vocabulary.merges)
    for key, value in (
        ("bos", vocabulary.bos_id),
        ("eos", vocabulary.eos_id),
        ("unk", vocabulary.unknown_id),
        ("pad", vocabulary.padding_id),
    ):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    if vocabulary.add_bos is not None:
        writer.add_add_bos_token(vocabulary.add_bos)
    if vocabulary.add_space_prefix is not None:
        writer.add_add_space_prefix(vocabulary.add_space_prefix)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)
    for key, value in vocabulary.extra.items():
        writer.add_key_value(f"tokenizer.ggml.{key}", value[0], value[1])


@functools.cache
def _name_map(architecture: str, num_layers: int) -> gguf.TensorNameMap:
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture)
    return gguf.get_tensor_name_map(arch, num_layers)


def gguf_name(hf_name: str, architecture: str, num_layers: int) -> str:
    """The converter's name for a tensor, from gguf-py's own table."""
    names = _name_map(architecture, num_layers)
    mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, hf_name
    return str(mapped)


def to_interleaved(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half rows (x0..x(h-1), y0..y(h-1) per head) to GGUF pairs (x0 y0 x1 y1 ...)."""
    head_dim = weight.shape[0] // num_heads
    out = np.empty_like(weight)
    for head in range(num_heads):
        base = head * head_dim
        for i in range(head_dim // 2):
            out[base + 2 * i] = weight[base + i]
            out[base + 2 * i + 1] = weight[base + head_dim // 2 + i]
    return out


def llama3_rope_divisors(config: dict[str, Any]) -> np.ndarray:
    """``rope_freqs.weight`` as the converter computes it (float32 frequencies, Python math)."""
    rope = config["rope_parameters"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    original = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def stored(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back after ``values`` are stored as ``kind``."""
    return gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).reshape(values.shape)


def write_gguf(
    path: Path,
    model_dir: Path,
    *,
    kind: gguf.GGMLQuantizationType = Q.F32,
    architecture: str | None = None,
    vocabulary: Vocabulary | None = None,
    override_kind: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra_metadata: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
) -> Path:
    """The checkpoint in ``model_dir`` as the converter writes it; matrices stored as ``kind``."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture or GGUF_ARCHITECTURE[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    if vocabulary is None:
        vocabulary = byte_vocabulary(config["vocab_size"])
        vocabulary.padding_id = config.get("pad_token_id")
    write_vocabulary(writer, vocabulary)
    for key, (value, value_type) in (extra_metadata or {}).items():
        writer.add_key_value(key, value, value_type)
    for name, values in _converted_tensors(model_dir, config, arch):
        chosen = (override_kind or {}).get(name, kind if values.ndim == 2 else Q.F32)
        if chosen == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif chosen == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif chosen == Q.I32:
            writer.add_tensor(name, values.astype(np.int32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, chosen), raw_dtype=chosen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(
    path: Path,
    model_dir: Path,
    *,
    kind: gguf.GGMLQuantizationType = Q.F32,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    override_kind: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """A llama checkpoint (kvgate's tiny model) as a GGUF file with the byte vocabulary."""
    config = json.loads((model_dir / "config.json").read_text())
    vocabulary = byte_vocabulary(config["vocab_size"], model=tokenizer_model)
    return write_gguf(
        path,
        model_dir,
        kind=kind,
        architecture=architecture,
        vocabulary=vocabulary,
        override_kind=override_kind,
    )


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The global (full-attention) RoPE object, from either config layout."""
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        return dict(rope["full_attention"])
    if rope:
        return dict(rope)
    scaling = config.get("rope_scaling") or {}
    return {"rope_type": "default", **scaling, "rope_theta": config.get("rope_theta", 10000.0)}


def _write_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], arch: str) -> None:
    """The converter's metadata for ``arch``: the shared keys, then each model's own."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = _rope(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch != "gemma2":  # Gemma 2's converter writes no base: llama.cpp's 10,000 applies
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
    if arch in _GEMMA:
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if arch == "gemma3":
        local = config["rope_parameters"]["sliding_attention"]["rope_theta"]
        writer.add_rope_freq_base_swa(local)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
            original = config["original_max_position_embeddings"]
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(factor)


def _converted_tensors(
    model_dir: Path, config: dict[str, Any], arch: str
) -> list[tuple[str, np.ndarray]]:
    """Every tensor renamed and rewritten as the converter does, plus its RoPE tables."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    layers = config["num_hidden_layers"]
    out: list[tuple[str, np.ndarray]] = []
    for name, tensor in hf_tensors(model_dir).items():
        values = tensor.float().numpy()
        if arch in _GEMMA and name == "lm_head.weight":
            continue  # tied; the converter skips a stored copy
        module = name.split(".")[-2]
        if arch == "llama" and module in ("q_proj", "k_proj"):
            values = to_interleaved(values, heads if module == "q_proj" else kv_heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        out.append((gguf_name(name, arch, layers), values))
    rope = _rope(config)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_divisors(config)))
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        out.append(("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)))
        out.append(("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)))
    return out


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors
