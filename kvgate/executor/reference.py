"""The unpaged reference: one request at a time, contiguous K/V per plane, no chunks, no batches.

It is the specification the paged executor is tested against (same tokens, same exit depths):

```
prompt:  h = embed(prompt); for d in 1..R: h = core pass at plane d over every prompt position
         output 0 = sample(coda(h[last]))  at position P, exit depth R
decode:  token t at position p: h = embed(t); for d = 1, 2, ...: core pass at plane d;
         on exit at d: K/V of p at plane d is copied into planes d+1..R (LAST_EXITED);
         output = sample(coda(h)) at position p + 1, exit depth d
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgate.executor.exit_policy import decide, uses_gate
from kvgate.executor.logits_processing import RowContext
from kvgate.executor.model import LayerAttention, Model
from kvgate.executor.requests import is_finished
from kvgate.executor.sampler import SampleRow, sample_each
from kvgate.grammar import TokenVocabulary
from kvgate.protocol.enums import ExitPolicy
from kvgate.protocol.step import NewRequest
from kvgate.protocol.stopping import StopRule


def dense_causal_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """``query [n, Hq, D]`` at int64 ``query_positions [n]`` over ``keys/values [T, Hkv, D]``
    (context positions 0..T-1).

    Query i at position p sees positions k <= p, and with ``sliding_window = W`` only those with
    ``p - W < k`` (the last W positions including its own: transformers' ``kv_idx > q_idx -
    sliding_window``). Scores are ``s = (q . k) * softmax_scale``; with ``logit_softcap = c``
    they become ``c * tanh(s / c)`` before the mask and the softmax (Gemma 2).
    """
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->nht", query.float(), k) * softmax_scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    context = torch.arange(keys.shape[0], device=keys.device)
    hidden = context[None, :] > query_positions[:, None]
    if sliding_window is not None:
        hidden |= context[None, :] <= query_positions[:, None] - sliding_window
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    out = torch.einsum("nht,thd->nhd", torch.softmax(scores, dim=-1), v)
    return out.to(query.dtype)


@dataclass
class _Plane:
    """Contiguous K/V of one depth, every layer: ``[capacity, Hkv, D]`` each, ``length`` filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0


@dataclass
class ReferenceResult:
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)


class _Sequence:
    def __init__(self, model: Model, capacity: int):
        cfg = model.config
        shape = (capacity, cfg.num_kv_heads, cfg.head_dim)

        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=model.dtype, device=model.device)

        self.model = model
        self.planes = [
            _Plane(
                [zeros() for _ in range(cfg.num_layers)], [zeros() for _ in range(cfg.num_layers)]
            )
            for _ in range(cfg.num_loops)
        ]

    def core_pass(self, hidden: torch.Tensor, start: int, depth: int) -> torch.Tensor:
        """Positions ``[start, start + n)`` at plane ``depth``, which must hold ``[0, start)``."""
        plane = self.planes[depth - 1]
        if plane.length != start:
            raise AssertionError(f"plane {depth} holds {plane.length} positions, not {start}")
        n = hidden.shape[0]
        end = start + n
        positions = torch.arange(start, end, device=hidden.device)

        def attention(
            layer: int,
            settings: LayerAttention,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
        ) -> torch.Tensor:
            plane.keys[layer][start:end] = k
            plane.values[layer][start:end] = v
            return dense_causal_attention(
                q,
                plane.keys[layer][:end],
                plane.values[layer][:end],
                positions,
                settings.softmax_scale,
                sliding_window=settings.sliding_window,
                logit_softcap=settings.logit_softcap,
            )

        out = self.model.core_pass(hidden, positions, end - 1, attention)
        plane.length = end
        return out

    def copy_to_deeper_planes(self, position: int, depth: int) -> None:
        source = self.planes[depth - 1]
        for plane in self.planes[depth:]:
            if plane.length != position:
                raise AssertionError(
                    f"a deeper plane holds {plane.length} positions, not {position}"
                )
            for layer in range(len(plane.keys)):
                plane.keys[layer][position] = source.keys[layer][position]
                plane.values[layer][position] = source.values[layer][position]
            plane.length = position + 1


@torch.inference_mode()
def reference_generate(
    model: Model,
    request: NewRequest,
    *,
    policy: ExitPolicy = ExitPolicy.GATE,
    eos_token_id: int | None = None,
    vocabulary: TokenVocabulary | None = None,
) -> ReferenceResult:
    """Generate ``request`` from its prompt alone (its output fields are ignored); a request
    with a grammar needs the model's ``vocabulary``."""
    prompt = request.prompt_token_ids
    sampling, loops, num_loops = request.sampling, request.loops, model.num_loops
    seq = _Sequence(model, len(prompt) + sampling.max_tokens)
    result = ReferenceResult()
    stop = StopRule.of(sampling, eos_token_id)
    matcher = None
    if sampling.grammar is not None:
        assert vocabulary is not None, "a grammar needs the model's vocabulary"
        matcher = vocabulary.matcher(sampling.grammar)

    def emit(hidden: torch.Tensor, position: int, depth: int) -> None:
        outputs = result.output_token_ids
        allowed = None
        if matcher is not None and vocabulary is not None:
            bitmask = torch.zeros((1, vocabulary.mask_words), dtype=torch.int32)
            vocabulary.fill_masks([matcher], bitmask.data_ptr())
            bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.flatten()[: vocabulary.vocab_size].bool().unsqueeze(0)
            if not allowed.any():
                allowed[0, vocabulary.eos_token_id] = True
        context = RowContext(
            prompt=prompt,
            outputs=list(outputs),
            suppressed=stop.stopping_token_ids() if len(outputs) < sampling.min_tokens else (),
            constrained=matcher is not None,
        )
        row = SampleRow(request.request_id, position, sampling, context)
        (token,) = sample_each(model.logits(hidden), [row], allowed)
        outputs.append(token)
        result.exit_depths.append(depth)
        if matcher is not None:
            matcher.advance(token)

    hidden = model.embed(torch.tensor(prompt, device=model.device))
    for depth in range(1, num_loops + 1):
        hidden = seq.core_pass(hidden, 0, depth)
    emit(hidden[-1:], len(prompt), num_loops)
    while not is_finished(result.output_token_ids, sampling, eos_token_id):
        position = len(prompt) + len(result.output_token_ids) - 1
        hidden = model.embed(torch.tensor(result.output_token_ids[-1:], device=model.device))
        output_index = len(result.output_token_ids)
        remaining = 1.0
        for depth in range(1, num_loops + 1):
            hidden = seq.core_pass(hidden, position, depth)
            hazard = None
            if uses_gate(loops, policy, output_index, num_loops):
                hazard = float(model.exit_hazard(hidden)[0])
            decision = decide(
                depth=depth,
                loops=loops,
                policy=policy,
                num_loops=num_loops,
                output_index=output_index,
                remaining=remaining,
                hazard=hazard,
            )
            remaining = decision.remaining
            if decision.exited:
                seq.copy_to_deeper_planes(position, depth)
                emit(hidden, position + 1, depth)
                break
    return result


@torch.inference_mode()
def reference_logits(model: Model, token_ids: list[int], prefill_len: int) -> torch.Tensor:
    """fp32 logits ``[len(token_ids) - prefill_len + 1, V]`` of a plain (one-loop) model: the
    prefill of ``token_ids[:prefill_len]`` predicting the next token, then one decode step per
    remaining token, each predicting the one after it."""
    if model.num_loops != 1:
        raise ValueError("reference_logits covers one-loop models only")
    if not 1 <= prefill_len <= len(token_ids):
        raise ValueError(f"prefill_len {prefill_len} outside 1..{len(token_ids)}")
    seq = _Sequence(model, len(token_ids))
    prompt = torch.tensor(token_ids[:prefill_len], device=model.device)
    rows = [model.logits(seq.core_pass(model.embed(prompt), 0, 1)[-1:])]
    for position in range(prefill_len, len(token_ids)):
        token = torch.tensor(token_ids[position : position + 1], device=model.device)
        rows.append(model.logits(seq.core_pass(model.embed(token), position, 1)))
    return torch.cat(rows)
