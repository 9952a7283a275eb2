"""Small llama GGUF files written with gguf-py's writer, laid out as llama.cpp's converter does.

The q/k row permutation below is written from the GGUF layout description (rotate-half rows to
interleaved pairs, per head), independently of kvgate's inverse.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from kvgate.gpu_executor.tokenizer import BOS_TOKEN, EOS_TOKEN, _byte_to_char

CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
# GGUF name -> HF name stem, for the test's own writer.
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    stem = hf_name.removesuffix(".weight")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return top[stem] + ".weight"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}.weight"


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


def stored(values: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back after ``values`` are stored as ``kind``."""
    return gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind).reshape(values.shape)


def write_llama_gguf(
    path: Path,
    model_dir: Path,
    *,
    kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    override_kind: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """The tiny checkpoint in ``model_dir`` as a GGUF file; matrices stored as ``kind``."""
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= {n: t.float().numpy() for n, t in load_file(str(file)).items()}
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    chars = _byte_to_char()
    tokens = [chars[b] for b in range(256)] + [BOS_TOKEN, EOS_TOKEN]
    tokens += [f"<|pad{i}|>" for i in range(config["vocab_size"] - len(tokens))]
    types = [1] * 256 + [3, 3] + [4] * (len(tokens) - 258)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([])  # bytes only: every token is one byte
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHAT_TEMPLATE)
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }
    for name, original in tensors.items():
        projection = name.split(".")[-2]
        values = to_interleaved(original, heads[projection]) if projection in heads else original
        target = gguf_name(name)
        chosen = (override_kind or {}).get(target, kind if values.ndim == 2 else None)
        if chosen is None or chosen == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, values.astype(np.float32))
        elif chosen == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, values.astype(np.float16))
        elif chosen == gguf.GGMLQuantizationType.I32:
            writer.add_tensor(target, values.astype(np.int32))
        else:
            writer.add_tensor(target, gguf.quants.quantize(values, chosen), raw_dtype=chosen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors
