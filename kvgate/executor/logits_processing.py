"""Logit processors: what a request's sampling parameters do to its logits before the draw.

In order, on one row's fp32 logits ``[V]`` (the order vLLM applies them in)::

    grammar mask      tokens the request's grammar does not allow next   -> -inf
    logit_bias        + bias[token]
    min_tokens        the EOS and stop_token_ids while outputs < min_tokens -> -inf
                      (not on a grammar's row: there the grammar decides what may come)
    repetition        tokens in prompt + outputs: logit / r if positive, logit * r if not
    frequency         - frequency_penalty * count of the token among the outputs
    presence          - presence_penalty if the token is among the outputs at all

Each step depends only on the request's prompt, outputs and parameters, never on state kept
between steps: a request restored by recompute or migrated to another executor is processed
exactly as if it had never moved. (The counts are rebuilt from the outputs every step: a few
thousand ids per penalised row, copied without waiting for the device.)

Two forms of the same rules, as in the sampler: :func:`process_row` (one row, the statement of
the rules; the reference generation uses it) and :func:`process_batch` (every row of a step at
once, each operation batched over the rows that need it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgate.protocol.step import SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowContext:
    """What the processors read about one row beyond its parameters.

    ``prompt``/``outputs``: the request's tokens so far (the token being sampled is output
    ``len(outputs)``); ``suppressed``: tokens masked for ``min_tokens`` at this output (the
    executor fills it from the stop rule); ``constrained``: the row has a grammar, whose mask
    (a row of the step's ``allowed`` tensor) is applied.
    """

    prompt: Sequence[int] = ()
    outputs: Sequence[int] = ()
    suppressed: Sequence[int] = ()
    constrained: bool = False


def needs_processing(params: SamplingParams, context: RowContext) -> bool:
    return bool(
        context.constrained or params.logit_bias or context.suppressed or params.has_penalties
    )


# ------------------------------------------------------------------------- one row at a time


def process_row(
    logits: torch.Tensor,
    params: SamplingParams,
    context: RowContext,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[V]``: one row's logits after every processor (a copy; ``logits`` is unchanged).
    ``allowed``: bool ``[V]``, the grammar's mask (read only when the row is constrained)."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    if context.constrained:
        assert allowed is not None
        out = out.masked_fill(~allowed.to(out.device), NEG_INF)
    for token, bias in params.logit_bias.items():
        out[token] += torch.tensor(bias, dtype=torch.float32)
    if context.suppressed and not context.constrained:
        out[list(context.suppressed)] = NEG_INF
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        seen[list(context.prompt) + list(context.outputs)] = True
        penalty = torch.tensor(params.repetition_penalty, dtype=torch.float32)
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if params.frequency_penalty or params.presence_penalty:
        counts = torch.zeros(vocab, dtype=torch.float32, device=out.device)
        for token in context.outputs:
            counts[token] += 1.0
        frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32)
        presence = torch.tensor(params.presence_penalty, dtype=torch.float32)
        out = out - frequency * counts - presence * (counts > 0).to(torch.float32)
    return out


# ------------------------------------------------------------------------ every row at once


def _on(
    device: torch.device, values: Sequence[float] | Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def process_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[m, V]``: :func:`process_row` of every row of ``logits [m, V]``.

    ``allowed``: bool ``[c, V]`` on the logits' device, the masks of the ``c`` constrained rows
    in row order (None when no row is constrained). Returns ``logits`` itself (not a copy) when
    no row needs processing.
    """
    rows = range(len(params))
    if not any(needs_processing(params[i], contexts[i]) for i in rows):
        return logits
    device = logits.device
    masked = [i for i in rows if contexts[i].constrained]
    if not masked:
        out = logits.float().clone()
    else:
        assert allowed is not None and allowed.shape[0] == len(masked)
        if len(masked) == len(params):
            out = torch.where(allowed, logits.float(), NEG_INF)  # a new tensor: no clone needed
        else:
            out = logits.float().clone()
            index = _on(device, masked, torch.int64)
            out[index] = torch.where(allowed, out[index], NEG_INF)
    _add_bias(out, params, device)
    _suppress(out, contexts, device)
    _repetition(out, params, contexts, device)
    _frequency_presence(out, params, contexts, device)
    return out


def _add_bias(out: torch.Tensor, params: Sequence[SamplingParams], device: torch.device) -> None:
    row_ids, token_ids, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token)
            biases.append(bias)
    if row_ids:
        where = (_on(device, row_ids, torch.int64), _on(device, token_ids, torch.int64))
        out.index_put_(where, _on(device, biases, torch.float32), accumulate=True)


def _suppress(out: torch.Tensor, contexts: Sequence[RowContext], device: torch.device) -> None:
    row_ids, token_ids = [], []
    for i, c in enumerate(contexts):
        if not c.constrained:
            row_ids += [i] * len(c.suppressed)
            token_ids += list(c.suppressed)
    if row_ids:
        where = (_on(device, row_ids, torch.int64), _on(device, token_ids, torch.int64))
        out.index_put_(where, torch.tensor(NEG_INF, device=device))


def _occurrences(
    members: list[int], tokens_of: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """fp32 ``[len(members), V]``: how often each token occurs in each member's ``tokens_of``."""
    row_ids = [j for j, i in enumerate(members) for _ in tokens_of[i]]
    token_ids = [t for i in members for t in tokens_of[i]]
    counts = torch.zeros(len(members), vocab, dtype=torch.float32, device=device)
    if row_ids:
        where = (_on(device, row_ids, torch.int64), _on(device, token_ids, torch.int64))
        counts.index_put_(where, torch.ones(len(row_ids), device=device), accumulate=True)
    return counts


def _repetition(
    out: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext],
    device: torch.device,
) -> None:
    members = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not members:
        return
    seen_tokens = [list(c.prompt) + list(c.outputs) for c in contexts]
    seen = _occurrences(members, seen_tokens, out.shape[-1], device) > 0
    penalty = _on(device, [params[i].repetition_penalty for i in members], torch.float32)
    penalty = penalty.unsqueeze(1)
    index = _on(device, members, torch.int64)
    values = out[index]
    penalised = torch.where(values > 0, values / penalty, values * penalty)
    out[index] = torch.where(seen, penalised, values)


def _frequency_presence(
    out: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[RowContext],
    device: torch.device,
) -> None:
    members = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if not members:
        return
    counts = _occurrences(members, [c.outputs for c in contexts], out.shape[-1], device)
    frequency = _on(device, [params[i].frequency_penalty for i in members], torch.float32)
    presence = _on(device, [params[i].presence_penalty for i in members], torch.float32)
    index = _on(device, members, torch.int64)
    out[index] = (
        out[index]
        - frequency.unsqueeze(1) * counts
        - presence.unsqueeze(1) * (counts > 0).to(torch.float32)
    )
