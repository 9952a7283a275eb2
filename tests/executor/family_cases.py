"""The tiny configurations of each dense family the executor runs, chosen so every feature the
family has changes the tokens: windows shorter than the prompts, soft-caps the scores reach,
a query scale other than 1/√head_dim, per-layer RoPE with linear scaling on the global layers,
LongRoPE factors that differ from one another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.executor.hf_checkpoints import (
    PROMPTS,
    SHAPE,
    Written,
    cached_greedy,
    full_forward_greedy,
    write,
)

HEAD_DIM = 16
WINDOW = 8  # shorter than every prompt but the last, which the generation carries past it


@dataclass(frozen=True)
class Family:
    model_type: str
    extra: dict[str, Any]  # config arguments beyond SHAPE
    norm_center: float = 1.0  # Gemma stores norms as offsets from 1: drawn around 0
    # transformers' reference: a full forward per token, or its KV cache for RoPE that depends
    # on the call's length (see hf_checkpoints.cached_greedy)
    greedy: Callable[[Any, list[int]], list[int]] = full_forward_greedy
    prompts: tuple[tuple[int, ...], ...] = tuple(tuple(p) for p in PROMPTS)

    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **(SHAPE | self.extra))

    def write(self, name: str, directory: Path) -> Written:
        return write(
            self.config(),
            directory,
            seed=sum(map(ord, name)),
            norm_center=self.norm_center,
            prompts=[list(p) for p in self.prompts],
            greedy=self.greedy,
        )


_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 10.0, 12.0],
}

FAMILIES: dict[str, Family] = {
    # Llama's layer with transformers' sliding windows: Mistral slides every layer, Qwen2 and
    # Qwen3 (with use_sliding_window) the layers from max_window_layers on.
    "mistral-window": Family("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": Family(
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    "qwen3-window": Family(
        "qwen3",
        {
            "head_dim": HEAD_DIM,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    "qwen3": Family(
        "qwen3",
        {"head_dim": HEAD_DIM, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "olmo2": Family("olmo2", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    # Every Phi-3 layer slides when sliding_window is set (Phi-3-mini-4k: 2047 of 4096).
    "phi3": Family("phi3", {"sliding_window": 12}),
    # LongRoPE past an original context of 16: the prompts fit it (one fills it), generation
    # crosses it (a prompt longer than it is where kvgate departs from transformers: rope.py).
    "phi3-longrope": Family(
        "phi3",
        {
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 16,
            "rope_parameters": _LONGROPE,
        },
        greedy=cached_greedy,
        prompts=(tuple(PROMPTS[0]), tuple(PROMPTS[1][:16]), tuple(PROMPTS[2])),
    ),
    # yarn over an original context of 16 (trained to 4 times it): every position's rotation is
    # fixed, so transformers' full forward is the reference.
    "llama-yarn": Family(
        "llama",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    # dynamic NTK past a context of 16: the prompts are shorter than it, generation crosses it;
    # transformers' cached generation grows θ one position at a time, as kvgate does. A prompt
    # longer than 16 is where the two part (rope.py), and so is one of exactly 16 after a longer
    # sequence: transformers' rotary module keeps the θ it grew to until a call shorter than 16.
    "llama-dynamic": Family(
        "llama",
        {
            "max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
        },
        greedy=cached_greedy,
        prompts=(tuple(PROMPTS[0]), tuple(PROMPTS[1][:15]), tuple(PROMPTS[2])),
    ),
    "gemma2": Family(
        "gemma2",
        {
            "head_dim": HEAD_DIM,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
        },
        norm_center=0.0,
    ),
    "gemma3_text": Family(
        "gemma3_text",
        {
            "head_dim": HEAD_DIM,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 20,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        norm_center=0.0,
    ),
}


class WrittenFamilies:
    """Each family's checkpoint, written by transformers the first time a test asks for it and
    shared by every test of the session (the ``written`` fixture)."""

    def __init__(self, tmp_path_factory: Any) -> None:
        self._tmp = tmp_path_factory
        self._written: dict[str, Written] = {}

    def __getitem__(self, name: str) -> Written:
        if name not in self._written:
            self._written[name] = FAMILIES[name].write(name, self._tmp.mktemp(name))
        return self._written[name]
