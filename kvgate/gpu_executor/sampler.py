"""Token sampling: greedy, or temperature -> top-k -> top-p -> one seeded draw per row.

The draw for the token at ``position`` uses a generator seeded from a stable hash of
``(seed, position)`` when the request sets a seed (so the same prompt, settings and seed give
the same tokens under any request id, as vLLM's per-request seed does), or of
``(request_id, position)`` when it does not (every request draws afresh). Each row is processed
on its own, so a token never depends on the batch it was sampled in, on preemption, or on the
restore mode.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvgate.protocol.step import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SampleRow:
    request_id: str
    position: int  # the position the sampled token will occupy
    params: SamplingParams


def draw_seed(seed: int | None, request_id: str, position: int) -> int:
    """A 63-bit generator seed from (seed, position), or (request id, position) without a seed;
    stable across processes."""
    key = (f"id\x1f{request_id}" if seed is None else f"seed\x1f{seed}") + f"\x1f{position}"
    key_bytes = key.encode()
    digest = hashlib.blake2b(key_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities ``[V]`` after temperature, top-k and top-p (``temperature > 0``).

    top-k keeps the k largest logits (ties at the boundary kept); top-p then keeps the smallest
    prefix of the descending order whose mass reaches ``top_p`` (the top token always survives).
    """
    scaled = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum()


def draw(probs: torch.Tensor, seed: int) -> int:
    """Inverse-CDF draw over ``probs [V]`` in token-id order with one uniform from ``seed``."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    uniform = torch.rand((), generator=generator, dtype=torch.float64)
    weights = probs.double().cpu()
    cdf = torch.cumsum(weights, dim=-1)
    index = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))
    # u * total can round up to total: clamp to the last token that has any probability.
    last_possible = int(torch.nonzero(weights > 0.0)[-1])
    return min(index, last_possible)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    """One token per row of fp32 ``logits [len(rows), V]``."""
    if not rows:
        return []
    tokens: list[int | None] = [None] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.temperature == 0.0]
    if greedy:
        # Every row greedy (the common case): no copy of the logits rows.
        chosen = logits if len(greedy) == len(rows) else logits[greedy]
        picked = torch.argmax(chosen, dim=-1).tolist()
        for i, token in zip(greedy, picked, strict=True):
            tokens[i] = int(token)
    for i, row in enumerate(rows):
        if tokens[i] is None:
            probs = filtered_probs(logits[i], row.params)
            tokens[i] = draw(probs, draw_seed(row.params.seed, row.request_id, row.position))
    return [t for t in tokens if t is not None]


def token_logprobs(
    logits: torch.Tensor, token_id: int, top_n: int
) -> tuple[float, list[TokenLogprob]]:
    """The log-softmax of fp32 ``logits [V]`` at ``token_id``, and its ``top_n`` largest entries."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, top_n) if top_n else None
    alternatives = (
        []
        if top is None
        else [
            TokenLogprob(token_id=int(i), logprob=float(v))
            for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        ]
    )
    return float(logprobs[token_id]), alternatives
