"""Token sampling: the logit processors, then greedy, or temperature -> min-p -> top-k -> top-p
-> one seeded draw per row.

The processors (grammar mask, logit bias, min_tokens, penalties) are
:mod:`kvgate.executor.logits_processing`; they change what greedy and the draw see, never the
reported log-probabilities (those are the model's, before any processing, as vLLM reports them).

The draw for the token at ``position`` uses a generator seeded from a stable hash of
``(seed, position)`` when the request sets a seed (so the same prompt, settings and seed give
the same tokens under any request id, as vLLM's per-request seed does), or of
``(request_id, position)`` when it does not (every request draws afresh). A row's token never
depends on the batch it was sampled in, on preemption, or on the restore mode.

Two forms of the same rules:

- :func:`sample` (the executor's): every row of a step at once, on the logits' device. The
  filters and the draw are batched tensor operations with per-row parameters; the parameters
  and the seeded uniforms are made on the host (a few bytes per row) and copied without waiting
  (pinned memory on CUDA), so :func:`sample_on_device` never waits for the device, and the
  tokens come back in one copy. Each row's arithmetic is its own row's (row-wise softmax, sort,
  cumsum), so batching changes no result;
- :func:`sample_each`: one row at a time (:func:`filtered_probs`, :func:`draw`), the plain
  statement of the rules; the unpaged reference generation samples with it, so the executor's
  equivalence tests compare the two forms.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgate.executor.logits_processing import RowContext, process_batch, process_row
from kvgate.protocol.step import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SampleRow:
    request_id: str
    position: int  # the position the sampled token will occupy
    params: SamplingParams
    context: RowContext = field(default_factory=RowContext)


def draw_seed(seed: int | None, request_id: str, position: int) -> int:
    """A 63-bit generator seed from (seed, position), or (request id, position) without a seed;
    stable across processes."""
    key = (f"id\x1f{request_id}" if seed is None else f"seed\x1f{seed}") + f"\x1f{position}"
    key_bytes = key.encode()
    digest = hashlib.blake2b(key_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_uniform(row: SampleRow) -> float:
    """The one float64 uniform in [0, 1) that ``row``'s draw uses."""
    seed = draw_seed(row.params.seed, row.request_id, row.position)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return float(torch.rand((), generator=generator, dtype=torch.float64))


# ------------------------------------------------------------------------- one row at a time


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities ``[V]`` after temperature, min-p, top-k and top-p (``temperature > 0``).

    min-p drops tokens less likely than ``min_p`` times the most likely one; top-k keeps the k
    largest logits (ties at the boundary kept); top-p then keeps the smallest prefix of the
    descending order whose mass reaches ``top_p`` (the top token always survives).
    """
    scaled = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def draw(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw over ``probs [V]`` in token-id order at ``uniform`` in [0, 1)."""
    weights = probs.double().cpu()
    cdf = torch.cumsum(weights, dim=-1)
    target = torch.tensor(uniform, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, target, right=True))
    # u * total can round up to total: clamp to the last token that has any probability.
    last_possible = int(torch.nonzero(weights > 0.0)[-1])
    return min(index, last_possible)


def sample_each(
    logits: torch.Tensor, rows: list[SampleRow], allowed: torch.Tensor | None = None
) -> list[int]:
    """One token per row of fp32 ``logits [len(rows), V]``, one row at a time (``allowed``: as
    for :func:`sample`)."""
    tokens = []
    masks = iter(list(allowed) if allowed is not None else [])
    for i, row in enumerate(rows):
        mask = next(masks) if row.context.constrained else None
        processed = process_row(logits[i], row.params, row.context, mask)
        if row.params.temperature == 0.0:
            tokens.append(int(torch.argmax(processed)))
        else:
            tokens.append(draw(filtered_probs(processed, row.params), row_uniform(row)))
    return tokens


# ------------------------------------------------------------------------ every row at once


def _on(device: torch.device, values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without making the host wait for it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _batched_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """:func:`filtered_probs` of every row of ``logits [m, V]`` (every row sampled)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = _on(device, [r.params.temperature for r in rows], torch.float32)
    scaled = logits.float() / temperature.unsqueeze(1)
    min_ps = [r.params.min_p for r in rows]
    if max(min_ps) > 0.0:
        # Rows without min-p compare against 0 and keep everything.
        probs = torch.softmax(scaled, dim=-1)
        floor = _on(device, min_ps, torch.float32).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    ks = [r.params.top_k if r.params.top_k is not None else vocab for r in rows]
    if min(ks) < vocab:
        # The k-th largest of each filtered row from one top-k of the largest k asked (not a sort
        # of the vocabulary); rows without top-k (k = V) keep everything.
        widest = max(k for k in ks if k < vocab)
        k = _on(device, [min(k, widest) for k in ks], torch.int64).unsqueeze(1)
        kth = torch.topk(scaled, widest, dim=-1).values.gather(1, k - 1)
        filtered = _on(device, [k < vocab for k in ks], torch.bool).unsqueeze(1)
        scaled = scaled.masked_fill(filtered & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_ps = [r.params.top_p for r in rows]
    if min(top_ps) < 1.0:
        # Rows without top-p keep everything (not "mass before < 1.0", which rounding can miss).
        limit = [p if p < 1.0 else float("inf") for p in top_ps]
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= _on(device, limit, torch.float32).unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _batched_draw(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """:func:`draw` for every row of ``probs [m, V]``: int64 ``[m]`` on their device."""
    weights = probs.double()
    cdf = torch.cumsum(weights, dim=-1)
    uniforms = _on(probs.device, [row_uniform(r) for r in rows], torch.float64)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    vocab = probs.shape[-1]
    positive = (weights > 0.0).flip(-1)
    last_possible = (vocab - 1) - torch.argmax(positive.to(torch.uint8), dim=-1)
    return torch.minimum(index, last_possible)


def sample_on_device(
    logits: torch.Tensor, rows: list[SampleRow], allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 ``[len(rows)]`` on the logits' device: one token per row of fp32 ``logits``,
    queued on the device without waiting for it. ``allowed``: bool ``[c, V]`` on the logits'
    device, the grammar masks of the ``c`` constrained rows in row order (None when no row
    is)."""
    logits = process_batch(logits, [r.params for r in rows], [r.context for r in rows], allowed)
    tokens = torch.argmax(logits, dim=-1)
    drawn = [i for i, row in enumerate(rows) if row.params.temperature != 0.0]
    if drawn:
        index = _on(logits.device, drawn, torch.int64)
        chosen = [rows[i] for i in drawn]
        tokens = tokens.index_copy(
            0, index, _batched_draw(_batched_probs(logits[index], chosen), chosen)
        )
    return tokens


def sample(
    logits: torch.Tensor, rows: list[SampleRow], allowed: torch.Tensor | None = None
) -> list[int]:
    """One token per row of fp32 ``logits [len(rows), V]``, every row at once on their device."""
    if not rows:
        return []
    return [int(t) for t in sample_on_device(logits, rows, allowed).tolist()]


def logprob_fields(
    logits: torch.Tensor, rows: list[SampleRow], tokens: list[int]
) -> list[dict[str, Any]]:
    """Per row: the ``SampledToken`` logprob fields its request asked for (``{}`` if none).

    The log-softmax of the logits before temperature and filters, batched over the rows that
    ask (one top-k per distinct count asked, so a row's list never depends on its neighbours').
    """
    fields: list[dict[str, Any]] = [{} for _ in rows]
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asking:
        return fields
    device = logits.device
    logprobs = torch.log_softmax(logits[_on(device, asking, torch.int64)].float(), dim=-1)
    chosen = _on(device, [tokens[i] for i in asking], torch.int64).unsqueeze(1)
    picked = logprobs.gather(1, chosen).squeeze(1).tolist()
    counts = [rows[i].params.logprobs or 0 for i in asking]
    alternatives: dict[int, list[TokenLogprob]] = {}
    for n in sorted(set(counts) - {0}):
        members = [j for j, c in enumerate(counts) if c == n]
        top = torch.topk(logprobs[_on(device, members, torch.int64)], n, dim=-1)
        for j, values, ids in zip(members, top.values.tolist(), top.indices.tolist(), strict=True):
            alternatives[j] = [
                TokenLogprob(token_id=int(t), logprob=float(v))
                for t, v in zip(ids, values, strict=True)
            ]
    for j, i in enumerate(asking):
        fields[i] = {"logprob": float(picked[j]), "top_logprobs": alternatives.get(j, [])}
    return fields
