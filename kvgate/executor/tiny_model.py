"""``kvgate make-tiny-model``: a small random checkpoint in the exact Hugging Face layout.

Tests and the demo load these like any real model (config.json, safetensors shards with their
index, a byte-level tokenizer.json). Nothing is downloaded.

Random weights are scaled so that generation is numerically robust: RMS-normed hidden states
meet an LM head whose logits have a standard deviation of ``logit_scale`` (default 8), so the top
two logits are almost never within rounding distance of each other, and batching (which changes
fp32 summation order) cannot flip a greedy choice.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save_file

from kvgate.executor.config import parse_config
from kvgate.executor.tokenizer import (
    BOS_TOKEN,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN,
    build_byte_tokenizer,
)
from kvgate.executor.weights import INDEX_FILE, SINGLE_FILE, expected_shapes
from kvgate.protocol.enums import ModelFamily

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TinyModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    family: ModelFamily = ModelFamily.LLAMA
    model_type: Literal["llama", "qwen2", "mistral"] = "llama"  # llama family only
    num_loops: Annotated[int, Field(ge=1, le=16)] = 1
    vocab_size: Annotated[int, Field(ge=8)] = 272  # 256 bytes, <|bos|>, <|eos|>, padding
    hidden_size: Annotated[int, Field(ge=8)] = 64
    intermediate_size: Annotated[int, Field(ge=8)] | None = None
    num_layers: Annotated[int, Field(ge=1)] = 2
    num_heads: Annotated[int, Field(ge=1)] = 4
    num_kv_heads: Annotated[int, Field(ge=1)] = 2
    max_position_embeddings: Annotated[int, Field(ge=16)] = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    num_shards: Annotated[int, Field(ge=1)] = 1
    tokenizer: bool | None = None  # None: write one when the vocabulary can hold bytes + specials
    eos_token_id: Annotated[int, Field(ge=0)] | None = None
    exit_gate_bias: float = 0.0
    logit_scale: Annotated[float, Field(gt=0.0)] = 8.0
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    seed: int = 0

    @property
    def with_tokenizer(self) -> bool:
        fits = self.vocab_size >= BYTE_VOCAB_SIZE + 2
        return fits if self.tokenizer is None else self.tokenizer


def tiny_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The config.json of ``spec`` (the Ouro layout for the looped family)."""
    looped = spec.family is ModelFamily.LOOPED
    if looped and spec.model_type != "llama":
        raise ValueError("model_type applies to the llama family only")
    if not looped and spec.num_loops != 1:
        raise ValueError("the llama family has exactly one loop")
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError("hidden_size must divide into num_heads, num_heads into num_kv_heads")
    if spec.with_tokenizer and spec.vocab_size < BYTE_VOCAB_SIZE + 2:
        raise ValueError(f"a byte tokenizer needs vocab_size >= {BYTE_VOCAB_SIZE + 2}")
    eos = spec.eos_token_id
    if eos is None:
        eos = BYTE_VOCAB_SIZE + 1 if spec.with_tokenizer else spec.vocab_size - 1
    model_type = "ouro" if looped else spec.model_type
    config: dict[str, Any] = {
        "architectures": ["OuroForCausalLM" if looped else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size or 2 * spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "bos_token_id": BYTE_VOCAB_SIZE if spec.with_tokenizer else None,
        "eos_token_id": eos,
    }
    if model_type == "qwen2":
        config |= {"use_sliding_window": False, "sliding_window": None}
    if looped:
        config |= {"total_ut_steps": spec.num_loops, "early_exit_threshold": 1.0}
    return config


def _random_tensor(
    name: str, shape: tuple[int, ...], spec: TinyModelSpec, gen: torch.Generator
) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("_2.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name == "model.early_exit_gate.bias":
        return torch.full(shape, spec.exit_gate_bias)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight" and not spec.tie_word_embeddings:
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    if name in {"lm_head.weight", "model.embed_tokens.weight"}:
        # Tied: the embedding doubles as the LM head; its scale sets the logit spread.
        return torch.randn(shape, generator=gen) * (spec.logit_scale / math.sqrt(fan_in))
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def make_tiny_model(directory: Path | str, spec: TinyModelSpec | None = None) -> Path:
    """Write config.json, safetensors shard(s) (+ index) and tokenizer.json into ``directory``."""
    spec = spec or TinyModelSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    raw_config = tiny_config(spec)
    shapes = expected_shapes(parse_config(raw_config))
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = _DTYPES[spec.dtype]
    tensors = {
        name: _random_tensor(name, shape, spec, gen).to(dtype).contiguous()
        for name, shape in shapes.items()
    }
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    names = list(tensors)
    if spec.num_shards == 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        per_shard = math.ceil(len(names) / spec.num_shards)
        for index in range(spec.num_shards):
            file = f"model-{index + 1:05d}-of-{spec.num_shards:05d}.safetensors"
            chunk = names[index * per_shard : (index + 1) * per_shard]
            save_file({n: tensors[n] for n in chunk}, str(out / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(chunk, file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index_body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index_body, indent=2) + "\n")
    if spec.with_tokenizer:
        tokenizer = build_byte_tokenizer()
        assert tokenizer.token_id(BOS_TOKEN) == BYTE_VOCAB_SIZE
        assert tokenizer.token_id(EOS_TOKEN) == BYTE_VOCAB_SIZE + 1
        tokenizer.save(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyModelSpec()
    parser.add_argument("directory", type=Path, help="where to write the checkpoint")
    parser.add_argument("--family", choices=[f.value for f in ModelFamily], default="llama")
    parser.add_argument("--model-type", choices=["llama", "qwen2", "mistral"], default="llama")
    parser.add_argument(
        "--loops", type=int, default=None, help="loops R (looped family; default 4)"
    )
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=None)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument(
        "--max-position-embeddings", type=int, default=defaults.max_position_embeddings
    )
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer.json")
    parser.add_argument("--exit-gate-bias", type=float, default=defaults.exit_gate_bias)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    family = ModelFamily(args.family)
    loops = args.loops if args.loops is not None else (4 if family is ModelFamily.LOOPED else 1)
    spec = TinyModelSpec(
        family=family,
        model_type=args.model_type,
        num_loops=loops,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tied,
        num_shards=args.shards,
        tokenizer=False if args.no_tokenizer else None,
        exit_gate_bias=args.exit_gate_bias,
        dtype=args.dtype,
        seed=args.seed,
    )
    try:
        out = make_tiny_model(args.directory, spec)
    except ValueError as exc:
        print(f"kvgate make-tiny-model: {exc}")
        return 2
    print(f"wrote a {spec.family} model (loops={spec.num_loops}) to {out}")
    return 0
