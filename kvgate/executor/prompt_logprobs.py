"""Prompt scoring: each prompt token's log-probability given the tokens before it, from the
hidden states a fill row computes anyway.

A fill row over positions ``[s, e)`` ends, at full depth, with one hidden state per position;
the state at position ``p`` predicts the token at ``p + 1``::

    positions   s      s+1     ...   e-1
    predicts    s+1    s+2     ...   e        (only tokens of the prompt: e < P)

so the row reports the prompt tokens ``[s + 1, min(e, P - 1) + 1)``; position 0's token has no
context and no log-probability. The log-probabilities are the log-softmax of the raw logits, as
for sampled tokens. The logits are made a slice of positions at a time, so a long chunk does not
hold ``[chunk, V]`` floats at once.
"""

from __future__ import annotations

from typing import Final

import torch

from kvgate.executor.model import Model
from kvgate.executor.requests import RequestState
from kvgate.protocol.step import PrefillRow, PromptLogprobs, TokenLogprob

POSITIONS_PER_SLICE: Final = 64


def prompt_logprobs(
    model: Model, state: RequestState, row: PrefillRow, hidden: torch.Tensor
) -> list[PromptLogprobs]:
    """The row's prompt log-probabilities (none when the row holds no prompt token after the
    first); ``hidden [row.num_tokens, H]``, one state per position of the row at full depth."""
    prompt = state.prompt
    first = row.token_start + 1  # the first scored position
    last = min(row.token_end, len(prompt) - 1)  # the last scored position (inclusive)
    if last < first:
        return []
    targets = prompt[first : last + 1]
    count = state.sampling.prompt_logprobs or 0
    logprobs: list[float] = []
    top: list[list[TokenLogprob]] = []
    for start in range(0, len(targets), POSITIONS_PER_SLICE):
        chunk = targets[start : start + POSITIONS_PER_SLICE]
        scores = torch.log_softmax(model.logits(hidden[start : start + len(chunk)]), dim=-1)
        ids = torch.tensor(chunk, device=scores.device).unsqueeze(1)
        logprobs += scores.gather(1, ids).squeeze(1).tolist()
        if count:
            best = torch.topk(scores, count, dim=-1)
            top += [
                [
                    TokenLogprob(token_id=int(t), logprob=float(v))
                    for t, v in zip(i, val, strict=True)
                ]
                for i, val in zip(best.indices.tolist(), best.values.tolist(), strict=True)
            ]
    return [
        PromptLogprobs(
            request_id=state.request_id,
            first_position=first,
            token_ids=list(targets),
            logprobs=logprobs,
            top_logprobs=top,
        )
    ]
