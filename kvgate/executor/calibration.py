"""Startup measurements: the profiling forward that sizes the KV cache on a GPU, and the cost
figures (host bandwidth, prefill time per token and pass) an executor reports to the scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvgate import kernels
from kvgate.executor.kv_cache import KVCache
from kvgate.executor.model import LayerAttention, Model
from kvgate.executor.reference import dense_causal_attention

# The profiling forward computes logits for at most this many rows (one per sampled sequence).
_PROFILE_LOGIT_ROWS = 256


@dataclass(frozen=True)
class Costs:
    host_bandwidth_bytes_per_s: float
    prefill_token_pass_s: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def profile_forward(model: Model, num_tokens: int) -> None:
    """The largest forward a step runs: ``num_tokens`` positions through every loop, plus logits.

    Attention is dense here (no KV cache exists yet); it needs more memory than the paged kernels,
    so the measured peak errs on the safe side.
    """
    tokens = torch.arange(num_tokens, device=model.device) % model.config.vocab_size
    positions = torch.arange(num_tokens, device=model.device)

    def attention(
        layer: int, settings: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return dense_causal_attention(
            q,
            k,
            v,
            positions,
            settings.softmax_scale,
            sliding_window=settings.sliding_window,
            logit_softcap=settings.logit_softcap,
        )

    hidden = model.embed(tokens)
    for _ in range(model.num_loops):
        hidden = model.core_pass(hidden, positions, num_tokens - 1, attention)
    model.logits(hidden[-_PROFILE_LOGIT_ROWS:])


def measure_costs(
    model: Model, cache: KVCache, *, num_tokens: int = 256, num_blocks: int = 32
) -> Costs:
    """Swap ``num_blocks`` blocks out and back in (idle cache: their contents are rewritten
    unchanged), and time one ``num_tokens`` prefill through every loop after a warm-up."""
    ids = torch.arange(min(num_blocks, cache.num_blocks), dtype=torch.int64)
    began = time.perf_counter()
    keys, values = kernels.gather_blocks(cache.keys, cache.values, ids)
    kernels.scatter_blocks(cache.keys, cache.values, ids, keys, values)
    _synchronize(model.device)
    moved_bytes = 2 * cache.bytes_per_block * len(ids)  # to the host and back
    bandwidth = moved_bytes / max(time.perf_counter() - began, 1e-9)
    tokens = min(num_tokens, model.config.max_model_len)
    profile_forward(model, tokens)  # warm-up
    _synchronize(model.device)
    began = time.perf_counter()
    profile_forward(model, tokens)
    _synchronize(model.device)
    per_token_pass = (time.perf_counter() - began) / (tokens * model.num_loops)
    return Costs(bandwidth, max(per_token_pass, 1e-12))
