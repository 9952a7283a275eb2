"""Tiny random checkpoints written by transformers itself, and transformers' own greedy ids and
logits for them: the reference every family's tests hold kvgate's executor to.

A checkpoint is written the way transformers tests itself: a tiny configuration of the real
config class, ``from_config(..., attn_implementation="eager")``, weights re-drawn wide (the
default init collapses greedy decoding onto one token and hides differences), then
``save_pretrained`` (transformers 5's layout: ``rope_parameters``). :func:`as_transformers_4`
rewrites its config.json as transformers 4 wrote it, for the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvgate.executor.executor import Executor
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig

SHAPE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
PROMPTS = [
    [1, 17, 250, 3, 99, 41, 8, 300, 77, 5, 123, 64],
    [1, 200, 11, 9, 310, 45, 46, 47, 180, 6, 222, 31, 90, 14, 3, 101, 57],
    [1, 5],
]
MAX_TOKENS = 14


@dataclass(frozen=True)
class Written:
    model_dir: Path  # as transformers 5 wrote it: config.json with rope_parameters
    prompts: list[list[int]]
    greedy_ids: list[list[int]]  # transformers' greedy continuation of each prompt
    model: Any = field(repr=False)  # transformers' model, for logits
    # how the ids were computed (full_forward_greedy or cached_greedy)
    greedy: Callable[[Any, list[int]], list[int]] = field(repr=False)


def redraw_wide(model: Any, seed: int, norm_center: float = 1.0) -> None:
    """Weights with a wide spread (std 0.25), norm weights around ``norm_center`` (1 for norms
    that multiply by w, 0 for Gemma's that multiply by 1 + w): varied greedy paths that diverge
    at once when the math is off."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(norm_center + 0.1 * noise)
            else:
                parameter.copy_(0.25 * noise)


def full_forward_greedy(model: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy ids from a full forward over the whole sequence at every step (no KV cache):
    transformers' masks as written, nothing cached."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def cached_greedy(model: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy ids from transformers' forward with its KV cache: the prompt in one call, then one
    call per token, nothing recomputed. RoPE that depends on a call's length (dynamic NTK,
    LongRoPE) is then a function of each position, as kvgate computes it; ``generate()`` is the
    same except for Phi-3, which re-runs the whole sequence with the long factors once it
    passes the original context (see kvgate/executor/rope.py)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits
        ids = [int(logits[0, -1].argmax())]
        for position in range(len(prompt), len(prompt) + max_tokens - 1):
            logits = model(
                torch.tensor([ids[-1:]]),
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[position]]),
            ).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids


def generate_greedy(model: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy ids from transformers' ``generate()``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=SHAPE["pad_token_id"],
        )
    return [int(t) for t in out[0, len(prompt) :]]


def write(
    config: Any,
    directory: Path,
    *,
    seed: int,
    norm_center: float = 1.0,
    prompts: list[list[int]] = PROMPTS,
    greedy: Callable[[Any, list[int]], list[int]] = full_forward_greedy,
) -> Written:
    """Save a random model of ``config`` (a transformers config object) and its greedy ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    redraw_wide(model, seed, norm_center)
    model.save_pretrained(directory, safe_serialization=True)
    return Written(directory, prompts, [greedy(model, p) for p in prompts], model, greedy)


def config_of(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


def copy_with_config(model_dir: Path, target: Path, config: dict[str, Any]) -> Path:
    """The same weights under another config.json."""
    target.mkdir()
    for file in model_dir.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def _layer_pattern(layer_types: list[str]) -> int | None:
    """The sliding_window_pattern that gives ``layer_types`` (Gemma 3's old key), if any."""
    for pattern in range(1, len(layer_types) + 2):
        derived = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(len(layer_types))
        ]
        if derived == layer_types:
            return pattern
    return None


def as_transformers_4(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers 5 config.json as transformers 4 wrote it: top-level rope_theta /
    rope_scaling (null for plain RoPE), torch_dtype, no rope_parameters; Gemma 3's sliding
    layers' θ as rope_local_base_freq and its layers as sliding_window_pattern."""
    old = dict(config)
    rope = dict(old.pop("rope_parameters"))
    if "full_attention" in rope:  # Gemma 3: one object per layer type
        full, local = dict(rope["full_attention"]), dict(rope["sliding_attention"])
        assert local.pop("rope_type") == "default", "transformers 4 had no local scaling"
        old["rope_local_base_freq"] = local.pop("rope_theta")
        rope = full
        pattern = _layer_pattern(old.pop("layer_types"))
        assert pattern is not None, "transformers 4 gave Gemma 3 layers by pattern only"
        old["sliding_window_pattern"] = pattern
        old.pop("_sliding_window_pattern", None)
    old["rope_theta"] = rope.pop("rope_theta")
    rope.pop("partial_rotary_factor", None)  # Phi-3: transformers 5 writes the default in
    if config["model_type"] == "phi3":
        rope.pop("original_max_position_embeddings", None)  # top-level in Phi-3's files
    old["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    old["torch_dtype"] = old.pop("dtype")
    if "layer_types" in old:  # transformers 4 derived them by each type's rule
        old.pop("layer_types")
    if config["model_type"] == "gemma2":
        old["hidden_act"] = old["hidden_activation"]  # published Gemma 2 files state both
    old["transformers_version"] = "4.46.0"
    return old


def kvgate_greedy(
    model_dir: Path | Any,
    prompts: list[list[int]] = PROMPTS,
    cfg: DriverConfig | None = None,
    *,
    max_tokens: int = MAX_TOKENS,
    **executor: Any,
) -> list[list[int]]:
    """Every prompt at once through the paged executor (prompts cut into chunks of 5 unless
    ``cfg`` says otherwise); the greedy ids of each."""
    sampling = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [
        (wire.NewRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling), i)
        for i, p in enumerate(prompts)
    ]
    executor.setdefault("num_blocks", 96)
    executor.setdefault("block_size", 4)
    ex = Executor(model_dir, **executor)
    outputs = Driver(ex, requests, cfg or DriverConfig(chunk_size=5)).run()
    return [outputs[f"r{i}"][0] for i in range(len(prompts))]
