"""One step's forward: every prefill and decode row, as a few batched core passes.

A prefill row ``[s, e) x depths d1..d2`` is a chain of passes (one per depth); a decode row is one
pass. Passes are grouped into *levels*; a level is one batched core pass in which each pass reads
and writes the plane of its own depth (the kernels take one block table per attention row):

```
level:        0          1          2
row A  (d 1..3)  A@1 ─────▶ A@2 ─────▶ A@3        a row's passes run on consecutive levels
row B  (d 2)     B@2                              wavefront row: input saved by an earlier step
decode rows      x@1 y@3 z@2                      one pass each, any depth
```
A later chunk of the same request at the same plane runs on the same level as the earlier one or
after it: within a level every layer writes all new K/V before any attention reads it, so the
later chunk sees the earlier chunk's keys. Between levels, tokens that exit below ``R`` get their
K/V copied into the deeper planes (LAST_EXITED), before any deeper pass can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvgate import kernels
from kvgate.executor.exit_policy import decide, uses_gate
from kvgate.executor.kv_cache import KVCache
from kvgate.executor.logits_processing import RowContext
from kvgate.executor.model import LayerAttention, Model
from kvgate.executor.prompt_logprobs import prompt_logprobs
from kvgate.executor.requests import DecodeCursor, PendingHidden, RequestState, is_finished
from kvgate.executor.sampler import SampleRow, logprob_fields, sample
from kvgate.executor.structured import PendingMasks, StructuredOutputs
from kvgate.executor.timing import KernelTimer
from kvgate.protocol.enums import ExitPolicy
from kvgate.protocol.step import PrefillRow, PromptLogprobs, SampledToken
from kvgate.protocol.stopping import StopRule


@dataclass
class _Pass:
    """One request's positions through one core pass at ``depth``."""

    state: RequestState
    depth: int
    positions: list[int]  # ascending
    token_ids: list[int] | None = None  # input embeddings (depth 1) ...
    hidden: torch.Tensor | None = None  # ... or the previous pass's output [len(positions), H]


@dataclass
class _FillRow:
    state: RequestState
    row: PrefillRow
    start_level: int
    carry: torch.Tensor | None = None  # output of the last pass, for positions still active
    carry_positions: list[int] = field(default_factory=list)
    final_hidden: torch.Tensor | None = None  # [1, H] of the last fill position at depth R
    prompt_hidden: torch.Tensor | None = None  # [n, H] of every row position at depth R

    def level(self, depth: int) -> int:
        return self.start_level + depth - self.row.depth_first


@dataclass
class _DecodeRow:
    state: RequestState
    cursor: DecodeCursor
    exited: bool = False
    out: torch.Tensor | None = None  # [1, H]
    remaining: float = 1.0


@dataclass
class RowOutcomes:
    tokens: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_depths: list[int] = field(default_factory=list)
    decode_exited: list[bool] = field(default_factory=list)
    token_passes_per_depth: list[int] = field(default_factory=list)
    kernel_s: float = 0.0


def _start_levels(rows: list[tuple[RequestState, PrefillRow]]) -> list[int]:
    """Earliest level of each row's first pass that keeps same-plane chunks of one request in
    order (a later chunk may share a level with an earlier one, never precede it)."""
    last_level: dict[tuple[str, int], int] = {}
    starts = []
    for state, row in rows:
        depths = range(row.depth_first, row.depth_last + 1)
        start = 0
        for depth in depths:
            earlier = last_level.get((state.request_id, depth))
            if earlier is not None:
                start = max(start, earlier - (depth - row.depth_first))
        for depth in depths:
            last_level[(state.request_id, depth)] = start + depth - row.depth_first
        starts.append(start)
    return starts


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Maximal ranges ``[a, b)`` of consecutive positions (each becomes one attention row)."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class StepRunner:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        policy: ExitPolicy,
        eos_token_id: int | None,
        structured: StructuredOutputs,
    ):
        self.model = model
        self.cache = cache
        self.policy = policy
        self.eos_token_id = eos_token_id
        self.structured = structured

    @torch.inference_mode()
    def run(
        self, prefill: list[tuple[RequestState, PrefillRow]], decode: list[RequestState]
    ) -> RowOutcomes:
        """Execute validated rows; updates the request states in place."""
        timer = KernelTimer(self.model.device)
        outcome = RowOutcomes(token_passes_per_depth=[0] * self.model.num_loops)
        fills = [
            _FillRow(state, row, start)
            for (state, row), start in zip(prefill, _start_levels(prefill), strict=True)
        ]
        decodes = [
            _DecodeRow(s, s.cursor, remaining=s.cursor.remaining) for s in decode if s.cursor
        ]
        num_levels = max(
            [f.level(f.row.depth_last) + 1 for f in fills] + [1 if decodes else 0], default=0
        )
        # The grammar masks of every row that may sample, filled while the forward runs.
        masks = self.structured.begin(
            [f.state for f in fills if f.row.completes_fill and not f.state.is_recompute]
            + [d.state for d in decodes]
        )
        for level in range(num_levels):
            passes: list[_Pass] = []
            owners: list[_FillRow | _DecodeRow] = []
            for fill in fills:
                depth = fill.row.depth_first + level - fill.start_level
                if fill.row.depth_first <= depth <= fill.row.depth_last:
                    passes.append(self._fill_pass(fill, depth))
                    owners.append(fill)
            if level == 0:
                for row in decodes:
                    passes.append(self._decode_pass(row))
                    owners.append(row)
            outputs = self._core(passes, timer)
            copies: list[tuple[int, int]] = []
            gated: list[_DecodeRow] = []
            for owner, pass_, out in zip(owners, passes, outputs, strict=True):
                outcome.token_passes_per_depth[pass_.depth - 1] += len(pass_.positions)
                if isinstance(owner, _FillRow):
                    copies += self._after_fill_pass(owner, pass_, out)
                else:
                    owner.out = out
                    gated.append(owner)
            copies += self._decide_exits(gated, outcome)
            if copies:
                src = torch.tensor([c[0] for c in copies], dtype=torch.int64)
                dst = torch.tensor([c[1] for c in copies], dtype=torch.int64)
                with timer.measure():
                    kernels.copy_slots(
                        self.cache.keys,
                        self.cache.values,
                        src.to(self.model.device),
                        dst.to(self.model.device),
                    )
        self._coda(fills, decodes, outcome, masks)
        outcome.kernel_s = timer.total_s()
        return outcome

    # ----------------------------------------------------------------------------- passes

    def _fill_pass(self, fill: _FillRow, depth: int) -> _Pass:
        state, row = fill.state, fill.row
        positions = state.active_positions(row.token_start, row.token_end, depth)
        if depth == 1:
            tokens = [state.fill_token(p) for p in positions]
            return _Pass(state, depth, positions, token_ids=tokens)
        if depth == row.depth_first:
            pending = state.wavefront[(row.token_start, depth - 1)]
            return _Pass(state, depth, positions, hidden=pending.hidden)
        assert fill.carry is not None and fill.carry_positions == positions
        return _Pass(state, depth, positions, hidden=fill.carry)

    def _decode_pass(self, row: _DecodeRow) -> _Pass:
        cursor = row.cursor
        if cursor.passes_done == 0:
            return _Pass(row.state, 1, [cursor.position], token_ids=[cursor.token_id])
        return _Pass(row.state, cursor.depth, [cursor.position], hidden=cursor.hidden)

    def _slot(self, state: RequestState, depth: int, position: int) -> int:
        block_size = self.cache.block_size
        return state.block_tables[depth - 1][position // block_size] * block_size + (
            position % block_size
        )

    def _copies_to_deeper_planes(
        self, state: RequestState, depth: int, positions: list[int]
    ) -> list[tuple[int, int]]:
        return [
            (self._slot(state, depth, p), self._slot(state, deeper, p))
            for p in positions
            for deeper in range(depth + 1, state.num_loops + 1)
        ]

    def _after_fill_pass(
        self, fill: _FillRow, pass_: _Pass, out: torch.Tensor
    ) -> list[tuple[int, int]]:
        state, depth = fill.state, pass_.depth
        exiting = [p for p in pass_.positions if state.required_depth(p) == depth]
        keep = [i for i, p in enumerate(pass_.positions) if state.required_depth(p) > depth]
        if len(keep) == len(pass_.positions):
            fill.carry, fill.carry_positions = out, pass_.positions
        else:
            fill.carry = out[keep]
            fill.carry_positions = [pass_.positions[i] for i in keep]
        if depth == state.num_loops and fill.row.completes_fill and not state.is_recompute:
            fill.final_hidden = out[-1:]
        if depth == state.num_loops and state.wants_prompt_logprobs:
            fill.prompt_hidden = out  # prompt positions run every depth: one row per position
        return (
            self._copies_to_deeper_planes(state, depth, exiting) if depth < state.num_loops else []
        )

    def _decide_exits(self, rows: list[_DecodeRow], outcome: RowOutcomes) -> list[tuple[int, int]]:
        num_loops = self.model.num_loops
        need_gate = [
            r
            for r in rows
            if uses_gate(r.state.loops, self.policy, len(r.state.outputs), num_loops)
        ]
        hazards: dict[int, float] = {}
        if need_gate:
            values = self.model.exit_hazard(
                torch.cat([r.out for r in need_gate if r.out is not None])
            )
            hazards = {id(r): h for r, h in zip(need_gate, values.tolist(), strict=True)}
        copies: list[tuple[int, int]] = []
        for row in rows:
            decision = decide(
                depth=row.cursor.depth,
                loops=row.state.loops,
                policy=self.policy,
                num_loops=num_loops,
                output_index=len(row.state.outputs),
                remaining=row.remaining,
                hazard=hazards.get(id(row)),
            )
            row.exited, row.remaining = decision.exited, decision.remaining
            outcome.decode_positions.append(row.cursor.position)
            outcome.decode_depths.append(row.cursor.depth)
            outcome.decode_exited.append(row.exited)
            if row.exited and row.cursor.depth < num_loops:
                copies += self._copies_to_deeper_planes(
                    row.state, row.cursor.depth, [row.cursor.position]
                )
        return copies

    # ------------------------------------------------------------------------- the forward

    def _core(self, passes: list[_Pass], timer: KernelTimer) -> list[torch.Tensor]:
        """One batched core pass; returns each pass's output ``[len(positions), H]``."""
        model, device, bs = self.model, self.model.device, self.cache.block_size
        embed_ids = [t for p in passes if p.token_ids is not None for t in p.token_ids]
        embedded = iter(
            model.embed(torch.tensor(embed_ids, device=device)).split_with_sizes(
                [len(p.positions) for p in passes if p.token_ids is not None]
            )
            if embed_ids
            else []
        )
        inputs: list[torch.Tensor] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_start = [0]
        seq_lens: list[int] = []
        for p in passes:
            if not p.positions:
                continue
            inputs.append(next(embedded) if p.token_ids is not None else p.hidden)  # type: ignore[arg-type]
            table = p.state.block_tables[p.depth - 1]
            positions += p.positions
            slots += [table[q // bs] * bs + q % bs for q in p.positions]
            for start, end in _runs(p.positions):
                tables.append(table)
                query_start.append(query_start[-1] + end - start)
                seq_lens.append(end)
        if not positions:
            return [model.embed(torch.empty(0, dtype=torch.int64, device=device)) for _ in passes]
        width = max(len(t) for t in tables)
        table_tensor = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        )
        start_tensor = torch.tensor(query_start, dtype=torch.int32, device=device)
        lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        slot_tensor = torch.tensor(slots, dtype=torch.int64, device=device)
        cache = self.cache
        with timer.measure():
            # Block tables and slots are the same for every layer: plan and check them once per
            # distinct sliding window (what a query reads depends on it; layers of one window
            # share their plan).
            plans = {
                window: kernels.plan_attention(
                    table_tensor,
                    start_tensor,
                    lens_tensor,
                    num_tokens=len(positions),
                    num_blocks=cache.num_blocks,
                    block_size=bs,
                    compiled=model.ops.compiled,
                    per_token=model.batch_invariant,
                    sliding_window=window,
                )
                for window in model.attention_windows
            }
            write_plan = kernels.plan_write_kv(
                slot_tensor, num_blocks=cache.num_blocks, block_size=bs, compiled=model.ops.compiled
            )

        def attention(
            layer: int,
            settings: LayerAttention,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
        ) -> torch.Tensor:
            key_cache, value_cache = cache.layer(layer)
            with timer.measure():
                kernels.write_kv(k, v, key_cache, value_cache, slot_tensor, plan=write_plan)
                return kernels.paged_attention(
                    q,
                    key_cache,
                    value_cache,
                    table_tensor,
                    start_tensor,
                    lens_tensor,
                    settings.softmax_scale,
                    plan=plans[settings.sliding_window],
                    sliding_window=settings.sliding_window,
                    logit_softcap=settings.logit_softcap,
                )

        hidden = model.core_pass(
            torch.cat(inputs), torch.tensor(positions, device=device), max(positions), attention
        )
        outputs = iter(hidden.split_with_sizes([len(p.positions) for p in passes if p.positions]))
        empty = hidden[:0]
        return [next(outputs) if p.positions else empty for p in passes]

    # ------------------------------------------------------------------------------ coda

    def _sample_row(self, state: RequestState, position: int) -> SampleRow:
        outputs = state.outputs
        suppressed: list[int] = []
        if len(outputs) < state.sampling.min_tokens:
            suppressed = StopRule.of(state.sampling, self.eos_token_id).stopping_token_ids()
        context = RowContext(
            prompt=state.prompt,
            outputs=outputs,
            suppressed=suppressed,
            constrained=state.matcher is not None,
        )
        return SampleRow(state.request_id, position, state.sampling, context)

    def _coda(
        self,
        fills: list[_FillRow],
        decodes: list[_DecodeRow],
        outcome: RowOutcomes,
        masks: PendingMasks | None,
    ) -> None:
        for fill in fills:
            if fill.prompt_hidden is not None:
                outcome.prompt_logprobs += prompt_logprobs(
                    self.model, fill.state, fill.row, fill.prompt_hidden
                )
        finals = [f for f in fills if f.final_hidden is not None]
        exits = [d for d in decodes if d.exited]
        rows: list[SampleRow] = []
        hidden: list[torch.Tensor] = []
        for fill in finals:
            assert fill.final_hidden is not None
            rows.append(self._sample_row(fill.state, len(fill.state.prompt)))
            hidden.append(fill.final_hidden)
        for row in exits:
            assert row.out is not None
            rows.append(self._sample_row(row.state, row.cursor.position + 1))
            hidden.append(row.out)
        logits = self.model.logits(torch.cat(hidden)) if rows else None
        allowed = self.structured.allowed(masks, [r.request_id for r in rows])
        tokens = sample(logits, rows, allowed) if logits is not None else []
        extras = iter(logprob_fields(logits, rows, tokens) if logits is not None else [])
        sampled = iter(tokens)
        num_loops = self.model.num_loops
        for fill in fills:
            self._finish_fill_row(fill, next(sampled) if fill.final_hidden is not None else None)
            if fill.final_hidden is not None:
                state = fill.state
                outcome.tokens.append(
                    SampledToken(
                        request_id=state.request_id,
                        position=len(state.prompt),
                        token_id=state.outputs[-1],
                        exit_depth=num_loops,
                        **next(extras),
                    )
                )
        for row in decodes:
            if row.exited:
                self._advance_cursor(row, next(sampled), outcome, next(extras))
            else:
                self._advance_cursor(row, None, outcome, {})

    def _finish_fill_row(self, fill: _FillRow, token: int | None) -> None:
        state, row = fill.state, fill.row
        if state.fill_start is None:
            state.fill_start = row.token_start
            state.frontier = [row.token_start] * state.num_loops
        for depth in range(row.depth_first, row.depth_last + 1):
            state.frontier[depth - 1] = row.token_end
        if row.depth_first > 1:
            del state.wavefront[(row.token_start, row.depth_first - 1)]
        if row.depth_last < state.num_loops and fill.carry is not None:
            state.wavefront[(row.token_start, row.depth_last)] = PendingHidden(
                row.token_end, fill.carry.clone()
            )
        if row.completes_fill:
            if token is not None:
                state.outputs.append(token)
                state.exit_depths.append(state.num_loops)
                self.structured.advance(state, token)
            state.finish_fill(self.eos_token_id)

    def _advance_cursor(
        self,
        row: _DecodeRow,
        token: int | None,
        outcome: RowOutcomes,
        extras: dict[str, Any],
    ) -> None:
        state, cursor = row.state, row.cursor
        if token is None:
            assert row.out is not None
            cursor.passes_done += 1
            cursor.hidden = row.out.clone()
            cursor.remaining = row.remaining
            return
        state.outputs.append(token)
        state.exit_depths.append(cursor.depth)
        self.structured.advance(state, token)
        state.cursor = DecodeCursor(position=cursor.position + 1, token_id=token)
        state.finished = is_finished(state.outputs, state.sampling, self.eos_token_id)
        outcome.tokens.append(
            SampledToken(
                request_id=state.request_id,
                position=cursor.position + 1,
                token_id=token,
                exit_depth=cursor.depth,
                **extras,
            )
        )
