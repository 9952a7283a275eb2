"""A small deterministic planner that drives an Executor the way an admission service would.

It is test scaffolding, not a scheduler: no priorities, no admission limits beyond a row budget.
It exercises what the executor must get right — chunked and wavefront fills, mixed batches,
decode rows at any depth, block tables with shuffled ids, async plans with placeholder rows,
swap-out/swap-in and recompute restores at chosen moments — and collects every request's tokens
and exit depths from the step results.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvgate.executor.executor import Executor
from kvgate.protocol import step as wire


@dataclass
class DriverConfig:
    chunk_size: int = 8
    wavefront: bool = False
    mixed: bool = True  # prefill and decode rows in one step
    async_plans: bool = False  # plan step N+1 before step N's result is known
    max_rows: int = 64
    shuffle_seed: int = 0
    swap_after: dict[str, int] = field(default_factory=dict)  # rid -> outputs before swap-out
    recompute_after: dict[str, int] = field(default_factory=dict)  # rid -> outputs before free
    restore_delay: int = 2  # plans between a preemption and its restore


@dataclass
class _PlanParts:
    free: list[str] = field(default_factory=list)
    swap_out: list[str] = field(default_factory=list)
    new: list[wire.NewRequest] = field(default_factory=list)
    swap_in: list[wire.SwapIn] = field(default_factory=list)
    appends: list[wire.BlockAppend] = field(default_factory=list)
    prefill: list[wire.PrefillRow] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    positions: list[int | None] = field(default_factory=list)
    depths: list[int | None] = field(default_factory=list)


@dataclass
class _Request:
    new: wire.NewRequest
    arrival: int
    outputs: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    registered: bool = False
    chunks: list[tuple[int, int]] = field(default_factory=list)
    done_tasks: set[tuple[int, int]] = field(default_factory=set)  # (chunk, depth) planned
    fill_planned: bool = False
    cursor: tuple[int, int] | None = None  # (position, depth) known from results
    rows_in_flight: int = 0  # decode rows planned whose results are unknown
    finished: bool = False
    freed: bool = False
    swapped_pages: int | None = None
    restore_at: int | None = None
    preempted: set[str] = field(default_factory=set)  # "swap" / "recompute" events done


class Driver:
    def __init__(
        self, executor: Executor, requests: list[tuple[wire.NewRequest, int]], cfg: DriverConfig
    ):
        self.ex = executor
        self.cfg = cfg
        self.info = executor.info
        self.loops = executor.info.num_loops
        self.bs = executor.info.block_size
        ids = list(range(executor.info.num_blocks))
        random.Random(cfg.shuffle_seed).shuffle(ids)
        self.free_blocks = ids
        self.reqs = {r.request_id: _Request(r, arrival) for r, arrival in requests}
        self.step = 0
        self.results: list[wire.StepResult] = []
        self.max_rows_seen = 0
        self.mixed_steps = 0

    # ------------------------------------------------------------------------- outcomes

    def outputs(self) -> dict[str, tuple[list[int], list[int]]]:
        return {rid: (r.outputs, r.exit_depths) for rid, r in self.reqs.items()}

    def run(self, max_steps: int = 2000) -> dict[str, tuple[list[int], list[int]]]:
        in_flight: wire.StepPlan | None = None
        while not all(r.freed for r in self.reqs.values()):
            if self.step >= max_steps:
                raise AssertionError(f"driver made no progress in {max_steps} steps")
            plan = self._plan()
            if self.cfg.async_plans:
                if in_flight is not None:
                    self._execute(in_flight)
                in_flight = plan
            else:
                self._execute(plan)
        if in_flight is not None:
            self._execute(in_flight)
        return self.outputs()

    def _execute(self, plan: wire.StepPlan) -> None:
        result = self.ex.execute(plan)
        if result.error is not None:
            raise AssertionError(f"step {plan.step_id} rejected: {result.error}")
        self.results.append(result)
        self._apply(plan, result)

    # --------------------------------------------------------------------------- blocks

    def _take(self, n: int) -> list[int]:
        if len(self.free_blocks) < n:
            raise AssertionError("driver ran out of KV blocks; give the executor more")
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return taken

    def _ensure_pages(
        self, req: _Request, num_positions: int, appends: list[wire.BlockAppend]
    ) -> None:
        have = len(req.tables[0])
        need = -(-num_positions // self.bs)
        if need > have:
            new = [self._take(need - have) for _ in range(self.loops)]
            for table, ids in zip(req.tables, new, strict=True):
                table.extend(ids)
            appends.append(wire.BlockAppend(request_id=req.new.request_id, new_block_ids=new))

    def _release(self, req: _Request) -> None:
        for table in req.tables:
            self.free_blocks.extend(table)
        req.tables = [[] for _ in range(self.loops)]

    # ---------------------------------------------------------------------------- plans

    def _plan(self) -> wire.StepPlan:
        self.step += 1
        plan = _PlanParts()
        active = []
        for rid, req in self.reqs.items():
            if req.freed or req.arrival > self.step:
                continue
            if req.finished and req.rows_in_flight == 0:
                if req.registered or req.swapped_pages is not None:
                    plan.free.append(rid)
                if req.registered:
                    self._release(req)
                req.freed = True
                continue
            if req.finished or self._preempt(req, plan):
                continue
            if not req.registered:
                if req.restore_at is not None and self.step < req.restore_at:
                    continue
                if req.rows_in_flight:  # a recompute needs every output it replays
                    continue
                if req.swapped_pages is not None:
                    tables = [self._take(req.swapped_pages) for _ in range(self.loops)]
                    req.tables = tables
                    plan.swap_in.append(wire.SwapIn(request_id=rid, block_ids=tables))
                    req.swapped_pages = None
                    req.registered = True
                else:
                    plan.new.append(self._register(req))
            active.append(req)
        rows = 0
        decoding = []
        for req in active:
            if req.fill_planned:
                decoding.append(req)
            elif rows < self.cfg.max_rows:
                fill_rows = self._fill_rows(req, plan.appends)
                plan.prefill += fill_rows
                rows += len(fill_rows)
        if self.cfg.mixed or not plan.prefill:
            for req in decoding:
                if rows >= self.cfg.max_rows:
                    break
                if req.cursor is None and not self.cfg.async_plans:
                    continue
                self._decode_row(req, plan)
                rows += 1
        if plan.prefill and plan.decode_ids:
            self.mixed_steps += 1
        self.max_rows_seen = max(self.max_rows_seen, rows)
        return wire.StepPlan(
            step_id=self.step,
            free=plan.free,
            swap_out=plan.swap_out,
            new_requests=plan.new,
            swap_in=plan.swap_in,
            block_appends=plan.appends,
            prefill_rows=plan.prefill,
            decode=wire.DecodeRows(
                request_ids=plan.decode_ids, positions=plan.positions, depths=plan.depths
            ),
        )

    def _decode_row(self, req: _Request, plan: _PlanParts) -> None:
        position = self._decode_row_position(req)
        self._ensure_pages(req, position + 1, plan.appends)
        plan.decode_ids.append(req.new.request_id)
        if self.cfg.async_plans:
            plan.positions.append(None)
            plan.depths.append(None)
        else:
            assert req.cursor is not None
            plan.positions.append(req.cursor[0])
            plan.depths.append(req.cursor[1])
        req.rows_in_flight += 1

    def _decode_row_position(self, req: _Request) -> int:
        """The furthest position this row may feed (each unknown row may advance one)."""
        if req.cursor is not None:
            return req.cursor[0] + req.rows_in_flight
        prompt_len = len(req.new.prompt_token_ids)
        return prompt_len + max(len(req.outputs) - 1, 0) + req.rows_in_flight

    def _register(self, req: _Request) -> wire.NewRequest:
        rid = req.new.request_id
        restore = req.new.model_copy(
            update={"output_token_ids": list(req.outputs), "exit_depths": list(req.exit_depths)}
        )
        prompt_len = len(req.new.prompt_token_ids)
        fill_len = prompt_len + max(len(req.outputs) - 1, 0)
        size = self.cfg.chunk_size
        req.chunks = [(s, min(s + size, fill_len)) for s in range(0, fill_len, size)]
        req.done_tasks = set()
        req.fill_planned = False
        req.cursor = None
        req.tables = [[] for _ in range(self.loops)]
        req.registered = True
        assert rid == restore.request_id
        return restore

    def _fill_rows(self, req: _Request, appends: list[wire.BlockAppend]) -> list[wire.PrefillRow]:
        rid = req.new.request_id
        last = len(req.chunks) - 1
        if not self.cfg.wavefront:
            index = len({c for c, _ in req.done_tasks})
            start, end = req.chunks[index]
            self._ensure_pages(req, end, appends)
            for depth in range(1, self.loops + 1):
                req.done_tasks.add((index, depth))
            req.fill_planned = index == last
            return [
                wire.PrefillRow(
                    request_id=rid,
                    token_start=start,
                    token_end=end,
                    depth_first=1,
                    depth_last=self.loops,
                    completes_fill=index == last,
                )
            ]
        ready = [
            (c, d)
            for c in range(len(req.chunks))
            for d in range(1, self.loops + 1)
            if (c, d) not in req.done_tasks
            and (d == 1 or (c, d - 1) in req.done_tasks)
            and (c == 0 or (c - 1, d) in req.done_tasks)
        ]
        rows = []
        for c, d in ready:
            start, end = req.chunks[c]
            self._ensure_pages(req, end, appends)
            completes = c == last and d == self.loops
            rows.append(
                wire.PrefillRow(
                    request_id=rid,
                    token_start=start,
                    token_end=end,
                    depth_first=d,
                    depth_last=d,
                    completes_fill=completes,
                )
            )
        req.done_tasks |= set(ready)
        req.fill_planned = (last, self.loops) in req.done_tasks
        return rows

    def _preempt(self, req: _Request, plan: _PlanParts) -> bool:
        """Swap out or free for recompute once the request has enough (known) outputs.

        With async plans a decode row may still be in flight: the swap-out or free of this plan
        runs after it on the executor, and its outcome arrives before the restore."""
        rid = req.new.request_id
        if not req.registered or not req.fill_planned:
            return False
        if "swap" not in req.preempted and len(req.outputs) >= self.cfg.swap_after.get(rid, 10**9):
            req.preempted.add("swap")
            plan.swap_out.append(rid)
            req.swapped_pages = len(req.tables[0])
            self._release(req)
        elif "recompute" not in req.preempted and len(req.outputs) >= self.cfg.recompute_after.get(
            rid, 10**9
        ):
            req.preempted.add("recompute")
            plan.free.append(rid)
            self._release(req)
        else:
            return False
        req.registered = False
        req.restore_at = self.step + self.cfg.restore_delay
        return True

    # ---------------------------------------------------------------------------- results

    def _apply(self, plan: wire.StepPlan, result: wire.StepResult) -> None:
        for token in result.sampled_tokens():
            req = self.reqs[token.request_id]
            expected_position = len(req.new.prompt_token_ids) + len(req.outputs)
            assert token.position == expected_position, (token, expected_position)
            req.outputs.append(token.token_id)
            req.exit_depths.append(token.exit_depth)
            req.finished = self._finished(req)
        for row in plan.prefill_rows:
            if row.completes_fill:
                req = self.reqs[row.request_id]
                position = len(req.new.prompt_token_ids) + len(req.outputs) - 1
                req.cursor = (position, 1)
        outcome = result.decode
        for rid, position, depth, exited in zip(
            outcome.request_ids, outcome.positions, outcome.depths, outcome.exited, strict=True
        ):
            self.reqs[rid].cursor = (position + 1, 1) if exited else (position, depth + 1)
        for rid in plan.decode.request_ids:
            self.reqs[rid].rows_in_flight -= 1
        for rid in result.skipped_request_ids:
            assert self.reqs[rid].finished, f"executor skipped {rid}, which is not finished"

    def _finished(self, req: _Request) -> bool:
        sampling = req.new.sampling
        if len(req.outputs) >= sampling.max_tokens:
            return True
        eos = self.info.eos_token_id
        return eos is not None and not sampling.ignore_eos and req.outputs[-1] == eos
