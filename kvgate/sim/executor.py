"""A deterministic simulated executor that honours block tables the way a real one does.

The simulated model keeps one integer per K/V slot. The value a pass at depth ``d`` writes for
position ``p`` mixes the token's hidden state from depth ``d - 1`` with a digest of everything the
attention at plane ``d`` reads — positions ``[0, p)`` through the request's block table::

    v(p, 0) = embed(token_p, p)
    v(p, d) = mix(v(p, d-1), d, digest(plane d, positions [0, p)))      written to plane d, slot p
    token   = mix(v(p, exit), seed, p + 1) % vocab                       sampled at the exit pass

so a token is a pure function of (model seed, request seed, prompt, previous tokens, depths), and
any wrong block id, overwritten block, missing plane copy, lost snapshot or bad recompute changes
the outputs. Reading a slot nobody wrote is an error, never a silent zero. Hidden states between
passes are read back from plane ``d - 1`` (the real executor keeps them in memory instead).

Exit depths: a per-request trace, a fixed depth (``max_loops``), or a seeded hash of (request,
position) within ``[min_loops, max_loops]`` — never a function of scheduling.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Final

from kvgate.protocol import migration
from kvgate.protocol.migration import SnapshotHeader, SnapshotLayout
from kvgate.protocol.plan_check import Geometry, PlanError, PlanValidator, RequestView
from kvgate.protocol.step import (
    DecodeOutcomes,
    ExecutorCounters,
    ExecutorInfo,
    NewRequest,
    SampledTokens,
    StepError,
    StepPlan,
    StepResult,
    TokenLogprob,
    TokenRow,
)
from kvgate.protocol.stopping import StopRule
from kvgate.sim.hashing import mix, mix2, mix3, text_hash
from kvgate.sim.workload import ExitMode, ModelSection

MAX_MODEL_LEN: Final = 1 << 30  # the simulated model has no position limit of its own


class SimulationError(RuntimeError):
    """The plan asked for something a real executor would compute garbage from."""


@dataclass(slots=True)
class _ContextFold:
    """What ``_context`` folded last for one plane of a request, to start from next time: the
    full pages (their blocks and digests, and the fold after each) and the slots of the partial
    page after them (its block, the fold it started from, its values, the fold after each).
    A prefix is reused only while its blocks and values are still the ones folded."""

    blocks: list[int] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)
    folds: list[int] = field(default_factory=list)  # folds[k]: after k full pages
    changes: int = -1  # the executor's count of changed pages when the digests were checked
    partial_block: int = -1
    partial_start: int = 0
    partial_values: list[int] = field(default_factory=list)
    partial_folds: list[int] = field(default_factory=list)  # [i]: after i slots


@dataclass(slots=True)
class _SimRequest:
    new: NewRequest
    rid_hash: int
    stop: StopRule
    tables: list[list[int]]  # [plane][page] -> block id
    outputs: list[int]
    exit_depths: list[int]
    fill_length: int
    frontier: list[int | None]  # per plane: fill positions [fill_start, frontier) are done
    fill_start: int | None = None
    wavefront: dict[tuple[int, int], int] = field(default_factory=dict)  # (start, depth) -> end
    cursor_position: int = 0
    cursor_token: int = 0
    depth_done: int = 0
    filled: bool = False
    finished: bool = False
    context_folds: dict[int, _ContextFold] = field(default_factory=dict)  # per plane

    @property
    def num_pages(self) -> int:
        return len(self.tables[0])

    def plan_view(self) -> RequestView:
        return RequestView(
            fill_len=self.fill_length,
            prompt_len=len(self.new.prompt_token_ids),
            frontier=self.frontier,
            fill_start=self.fill_start,
            wavefront=self.wavefront,
            cursor=(self.cursor_position, self.depth_done + 1) if self.filled else None,
            finished=self.finished,
            tables=self.tables,
        )

    def token_at(self, position: int) -> int:
        prompt = self.new.prompt_token_ids
        return prompt[position] if position < len(prompt) else self.outputs[position - len(prompt)]


@dataclass(slots=True)
class _Snapshot:
    request: _SimRequest
    pages: int
    values: list[list[list[int | None]]] = field(default_factory=list)  # [plane][page][slot]

    @property
    def num_pages(self) -> int:
        return self.pages

    @property
    def num_blocks(self) -> int:
        return self.pages * len(self.values)

    def plan_view(self) -> RequestView:
        return self.request.plan_view()


class SimExecutor:
    def __init__(
        self,
        model: ModelSection,
        *,
        num_blocks: int,
        block_size: int,
        host_snapshot_blocks: int,
        executor_id: str = "sim-0",
    ) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host_snapshot_blocks = host_snapshot_blocks
        self.num_planes = model.loops
        self.executor_id = executor_id
        self._kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        # Writes to a page whose digest was known (a digest dropped): while this count stays, the
        # digests a context fold checked are still the pages' (``_context``).
        self._page_changes = 0
        self._digests: list[int | None] = [None] * num_blocks
        self._requests: dict[str, _SimRequest] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._exports: dict[str, tuple[SnapshotHeader, bytes]] = {}  # ticket -> one fetch
        self._staged: dict[str, _Snapshot] = {}  # ticket -> fetched, waiting for its adopt
        self._host_used = 0
        self._geometry = Geometry(
            num_blocks=num_blocks,
            block_size=block_size,
            num_loops=self.num_planes,
            vocab_size=model.vocab_size,
            max_model_len=MAX_MODEL_LEN,
            host_snapshot_blocks=host_snapshot_blocks,
        )

    @property
    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            executor_id=self.executor_id,
            model_family="sim",
            num_loops=self.num_planes,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            host_snapshot_blocks=self.host_snapshot_blocks,
            vocab_size=self.model.vocab_size,
            eos_token_id=self.model.eos_token_id,
            max_model_len=MAX_MODEL_LEN,
            kv_bytes_per_block=8 * self.block_size,
            snapshot_migration=True,
        )

    @property
    def counters(self) -> ExecutorCounters:
        return ExecutorCounters(
            num_requests=len(self._requests),
            num_snapshots=len(self._snapshots),
            host_blocks_used=self._host_used,
            num_exports=len(self._exports),
            num_staged=len(self._staged),
        )

    @property
    def snapshot_layout(self) -> SnapshotLayout:
        """The simulated model's identity: a snapshot means the same only under the same model."""
        fingerprint = hashlib.sha256(self.model.model_dump_json().encode()).hexdigest()
        return SnapshotLayout(
            model_fingerprint=f"sim:{fingerprint}",
            block_size=self.block_size,
            num_planes=self.num_planes,
            dtype="int64",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
        )

    def reset(self) -> None:
        self._requests.clear()
        self._snapshots.clear()
        self._exports.clear()
        self._staged.clear()
        self._host_used = 0

    # --- migration -----------------------------------------------------------------------------
    def take_export(self, ticket: str) -> tuple[SnapshotHeader, bytes] | None:
        """The exported snapshot under ``ticket``, once (None: unknown, taken or expired)."""
        return self._exports.pop(ticket, None)

    def drop_export(self, ticket: str) -> None:
        self._exports.pop(ticket, None)

    def stage_import(self, ticket: str, header: SnapshotHeader, payload: bytes) -> None:
        """Keep a fetched snapshot until a plan adopts it; ValueError when it does not fit."""
        problem = header.layout.mismatch(self.snapshot_layout)
        if problem is not None:
            raise ValueError(problem)
        try:
            values = json.loads(payload)
            request = _request_from_state(header.state, self.num_planes, self.model.eos_token_id)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable simulated snapshot: {exc}") from exc
        pages = header.num_pages
        if len(values) != self.num_planes or any(
            len(plane) != pages or any(len(page) != self.block_size for page in plane)
            for plane in values
        ):
            raise ValueError("the simulated snapshot's values do not match its page count")
        self._staged[ticket] = _Snapshot(request, pages, values)

    def drop_staged(self, ticket: str) -> None:
        self._staged.pop(ticket, None)

    def _export(self, request_id: str, ticket: str) -> None:
        snapshot = self._snapshots.pop(request_id, None)
        if snapshot is None:
            self._swap_out(request_id)
            snapshot = self._snapshots.pop(request_id)
        self._host_used -= snapshot.pages * self.num_planes
        payload = json.dumps(snapshot.values, separators=(",", ":")).encode()
        state = _state_of(snapshot.request)
        self._exports[ticket] = (
            migration.header(self.snapshot_layout, request_id, snapshot.pages, state, payload),
            payload,
        )

    def _adopt(self, request_id: str, ticket: str) -> None:
        snapshot = self._staged.pop(ticket)
        self._snapshots[request_id] = snapshot
        self._host_used += snapshot.pages * self.num_planes

    # --- the step ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        error = self._validate(plan)
        if error is not None:
            return StepResult(step_id=plan.step_id, error=error, counters=self.counters)
        for request_id in plan.free:
            self._requests.pop(request_id, None)
            snapshot = self._snapshots.pop(request_id, None)
            if snapshot is not None:
                self._host_used -= snapshot.pages * self.num_planes
        for request_id in plan.swap_out:
            self._swap_out(request_id)
        for export in plan.export:
            self._export(export.request_id, export.ticket)
        for adopt in plan.adopt:
            self._adopt(adopt.request_id, adopt.ticket)
        for new in plan.new_requests:
            self._register(new)
        for swap in plan.swap_in:
            self._swap_in(swap.request_id, swap.block_ids)
        for append in plan.block_appends:
            tables = self._requests[append.request_id].tables
            for plane, block_ids in enumerate(append.new_block_ids):
                tables[plane].extend(block_ids)
        tokens: list[TokenRow] = []
        for row in plan.prefill_rows:
            token = self._prefill(
                self._requests[row.request_id],
                row.token_start,
                row.token_end,
                row.depth_first,
                row.depth_last,
                row.completes_fill,
            )
            if token is not None:
                tokens.append(token)
        skipped: list[str] = []
        ids: list[str] = []
        positions: list[int] = []
        depths: list[int] = []
        exited: list[bool] = []
        for request_id in plan.decode.request_ids:
            request = self._requests[request_id]
            if request.finished:
                skipped.append(request_id)
                continue
            position, depth, token = self._decode_pass(request)
            ids.append(request_id)
            positions.append(position)
            depths.append(depth)
            exited.append(token is not None)
            if token is not None:
                tokens.append(token)
        outcomes = DecodeOutcomes(
            request_ids=ids, positions=positions, depths=depths, exited=exited
        )
        return StepResult(
            step_id=plan.step_id,
            sampled=_columns(tokens) if tokens else None,
            decode=outcomes,
            skipped_request_ids=skipped,
            counters=self.counters,
        )

    # --- validation (before any state changes) -------------------------------------------------
    def _validate(self, plan: StepPlan) -> StepError | None:
        try:
            PlanValidator(self._geometry, self._requests, self._snapshots, self._staged).validate(
                plan
            )
        except PlanError as exc:
            return exc.error
        return None

    # --- actions ---------------------------------------------------------------------------------
    def _register(self, new: NewRequest) -> None:
        outputs = list(new.output_token_ids)
        prompt_len = len(new.prompt_token_ids)
        self._requests[new.request_id] = _SimRequest(
            new=new,
            rid_hash=text_hash(new.request_id),
            stop=StopRule.of(new.sampling, self.model.eos_token_id),
            tables=[[] for _ in range(self.num_planes)],
            outputs=outputs,
            exit_depths=list(new.exit_depths),
            fill_length=prompt_len + len(outputs) - 1 if outputs else prompt_len,
            frontier=[None] * self.num_planes,
        )

    def _swap_out(self, request_id: str) -> None:
        request = self._requests.pop(request_id)
        values = [[list(self._kv[b]) for b in plane] for plane in request.tables]
        pages = len(request.tables[0])
        request.tables = [[] for _ in range(self.num_planes)]
        self._snapshots[request_id] = _Snapshot(request, pages, values)
        self._host_used += pages * self.num_planes

    def _swap_in(self, request_id: str, block_ids: list[list[int]]) -> None:
        snapshot = self._snapshots.pop(request_id)
        self._host_used -= snapshot.pages * self.num_planes
        for plane, ids in enumerate(block_ids):
            for page, block in enumerate(ids):
                self._kv[block] = list(snapshot.values[plane][page])
                self._drop_digest(block)
        snapshot.request.tables = [list(ids) for ids in block_ids]
        self._requests[request_id] = snapshot.request

    # --- the simulated model -------------------------------------------------------------------
    def _slot(self, request: _SimRequest, plane: int, position: int) -> tuple[int, int]:
        page, offset = divmod(position, self.block_size)
        return request.tables[plane - 1][page], offset

    def _read(self, request: _SimRequest, plane: int, position: int) -> int:
        block, offset = self._slot(request, plane, position)
        value = self._kv[block][offset]
        if value is None:
            raise SimulationError(
                f"{request.new.request_id}: K/V of position {position} at plane {plane} "
                f"(block {block}) was never written"
            )
        return value

    def _write(self, request: _SimRequest, plane: int, position: int, value: int) -> None:
        block, offset = self._slot(request, plane, position)
        self._kv[block][offset] = value
        self._drop_digest(block)

    def _drop_digest(self, block: int) -> None:
        if self._digests[block] is not None:
            self._digests[block] = None
            self._page_changes += 1

    def _context(self, request: _SimRequest, plane: int, position: int) -> int:
        """Digest of plane ``plane`` over positions ``[0, position)`` read through the table:
        the pages' digests folded in order, then the partial page's slots.

        A decode step attends to what the step before attended to plus one slot, so the fold
        starts from the longest prefix of the last one whose blocks, digests and slot values
        are unchanged (the same value as folding from scratch, at a slot's cost per row)."""
        full_pages, partial = divmod(position, self.block_size)
        table = request.tables[plane - 1]
        memo = request.context_folds.get(plane)
        if memo is None:
            memo = request.context_folds[plane] = _ContextFold(folds=[plane])
        digests = self._digests
        kept = len(memo.blocks)
        if (
            kept > full_pages
            or table[:kept] != memo.blocks
            or (
                memo.changes != self._page_changes
                and list(map(digests.__getitem__, memo.blocks)) != memo.digests
            )
        ):
            kept = 0
            while (
                kept < min(len(memo.blocks), full_pages)
                and table[kept] == memo.blocks[kept]
                and digests[table[kept]] == memo.digests[kept]
            ):
                kept += 1
            del memo.blocks[kept:], memo.digests[kept:], memo.folds[kept + 1 :]
        h = memo.folds[kept]
        for page in range(kept, full_pages):
            block = table[page]
            digest = digests[block]
            if digest is None:
                slots = self._kv[block]
                if None in slots:
                    raise SimulationError(
                        f"{request.new.request_id}: page {page} of plane {plane} has unwritten "
                        "slots below the attended position"
                    )
                digest = mix(*slots)  # type: ignore[arg-type]
                digests[block] = digest
            h = mix2(h, digest)
            memo.blocks.append(block)
            memo.digests.append(digest)
            memo.folds.append(h)
        memo.changes = self._page_changes
        if partial == 0:
            return h
        block = table[full_pages]
        slots = self._kv[block]
        values = memo.partial_values
        if (
            memo.partial_block != block
            or memo.partial_start != h
            or len(values) > partial
            or slots[: len(values)] != values
        ):
            memo.partial_block, memo.partial_start = block, h
            values.clear()
            memo.partial_folds = [h]
        folds = memo.partial_folds
        h = folds[-1]
        for offset in range(len(values), partial):
            value = slots[offset]
            if value is None:
                raise SimulationError(
                    f"{request.new.request_id}: K/V of position "
                    f"{full_pages * self.block_size + offset} at plane {plane} (block {block}) "
                    "was never written"
                )
            h = mix2(h, value)
            values.append(value)
            folds.append(h)
        return h

    def _pass(self, request: _SimRequest, position: int, depth: int) -> int:
        hidden = (
            mix3(self.model.seed, request.token_at(position), position)
            if depth == 1
            else self._read(request, depth - 1, position)
        )
        value = mix3(hidden, depth, self._context(request, depth, position))
        page, offset = divmod(position, self.block_size)  # _write, inlined: the hot path
        block = request.tables[depth - 1][page]
        self._kv[block][offset] = value
        if self._digests[block] is not None:  # _drop_digest, inlined
            self._digests[block] = None
            self._page_changes += 1
        return value

    def _copy_deeper(self, request: _SimRequest, position: int, depth: int, value: int) -> None:
        for plane in range(depth + 1, self.num_planes + 1):
            self._write(request, plane, position, value)

    def _required_depth(self, request: _SimRequest, position: int) -> int:
        prompt_len = len(request.new.prompt_token_ids)
        if position < prompt_len:
            return self.num_planes
        return request.exit_depths[position - prompt_len + 1]

    def _sample(self, request: _SimRequest, value: int, position: int, depth: int) -> TokenRow:
        seed = request.new.sampling.seed or 0
        token = mix3(value, seed, position) % self.model.vocab_size
        request.outputs.append(token)
        request.exit_depths.append(depth)
        if request.stop.finish_reason(len(request.outputs), token) is not None:
            request.finished = True
        sampling = request.new.sampling
        if sampling.logprobs is None:
            return request.new.request_id, position, token, depth, None, None
        # No model: a made-up log-probability that names the position it belongs to.
        logprob = -position / 1000
        top = [TokenLogprob(token_id=token, logprob=logprob)][: sampling.logprobs]
        return request.new.request_id, position, token, depth, logprob, top

    def _prefill(
        self,
        request: _SimRequest,
        start: int,
        end: int,
        depth_first: int,
        depth_last: int,
        completes: bool,
    ) -> TokenRow | None:
        if end > request.fill_length:
            raise SimulationError(f"{request.new.request_id}: row past the fill [{start},{end})")
        self._advance_fill(request, start, end, depth_first, depth_last)
        last_value = 0
        for depth in range(depth_first, depth_last + 1):
            for position in range(start, end):
                required = self._required_depth(request, position)
                if required < depth:
                    continue
                value = self._pass(request, position, depth)
                if required == depth:
                    self._copy_deeper(request, position, depth, value)
                if position == end - 1:
                    last_value = value
        if not completes:
            return None
        request.filled = True
        if request.outputs:  # recompute restore: the next output is already known
            request.cursor_position = request.fill_length
            request.cursor_token = request.outputs[-1]
            return None
        token = self._sample(request, last_value, end, self.num_planes)
        request.cursor_position = end
        request.cursor_token = token[2]
        return token

    def _advance_fill(
        self, request: _SimRequest, start: int, end: int, depth_first: int, depth_last: int
    ) -> None:
        """Record a row's progress the way the plan validator reads it (frontier, wavefront)."""
        if request.fill_start is None:
            request.fill_start = start
            request.frontier = [start] * self.num_planes
        for depth in range(depth_first, depth_last + 1):
            request.frontier[depth - 1] = end
        if depth_first > 1:
            request.wavefront.pop((start, depth_first - 1), None)
        if depth_last < self.num_planes:
            request.wavefront[(start, depth_last)] = end

    def _exit_depth(self, request: _SimRequest, position: int) -> int:
        loops = request.new.loops
        top = min(loops.max_loops or self.num_planes, self.num_planes)
        index = len(request.outputs)
        if loops.exit_trace is not None:
            return loops.exit_trace[index]
        if self.model.exit is ExitMode.FIXED:
            return top
        bottom = min(loops.min_loops, top)
        return bottom + mix(self.model.seed, request.rid_hash, position) % (top - bottom + 1)

    def _decode_pass(self, request: _SimRequest) -> tuple[int, int, TokenRow | None]:
        position = request.cursor_position
        depth = request.depth_done + 1
        value = self._pass(request, position, depth)
        if depth < self._exit_depth(request, position):
            request.depth_done = depth
            return position, depth, None
        self._copy_deeper(request, position, depth, value)
        token = self._sample(request, value, position + 1, depth)
        request.cursor_position = position + 1
        request.cursor_token = token[2]
        request.depth_done = 0
        return position, depth, token


def _columns(rows: list[TokenRow]) -> SampledTokens:
    """A step's sampled tokens as the columns a result carries (no object per token)."""
    ids, positions, token_ids, depths, logprobs, tops = (list(c) for c in zip(*rows, strict=True))
    asked = any(logprob is not None for logprob in logprobs)
    return SampledTokens(
        request_ids=ids, positions=positions, token_ids=token_ids, exit_depths=depths,
        logprobs=logprobs if asked else None, top_logprobs=tops if asked else None,
    )  # fmt: skip


def _state_of(request: _SimRequest) -> dict[str, Any]:
    """A snapshot's request state as JSON (its tables are the snapshot's pages)."""
    return {
        "new": request.new.model_dump(mode="json"),
        "outputs": request.outputs,
        "exit_depths": request.exit_depths,
        "fill_length": request.fill_length,
        "frontier": request.frontier,
        "fill_start": request.fill_start,
        "cursor_position": request.cursor_position,
        "cursor_token": request.cursor_token,
        "depth_done": request.depth_done,
        "filled": request.filled,
        "finished": request.finished,
    }


def _request_from_state(
    state: dict[str, Any], num_planes: int, eos_token_id: int | None
) -> _SimRequest:
    new = NewRequest.model_validate(state["new"])
    frontier = list(state["frontier"])
    if len(frontier) != num_planes:
        raise ValueError(f"{len(frontier)} planes in the state, the model has {num_planes}")
    return _SimRequest(
        new=new,
        rid_hash=text_hash(new.request_id),
        stop=StopRule.of(new.sampling, eos_token_id),
        tables=[[] for _ in range(num_planes)],
        outputs=[int(t) for t in state["outputs"]],
        exit_depths=[int(d) for d in state["exit_depths"]],
        fill_length=int(state["fill_length"]),
        frontier=frontier,
        fill_start=state["fill_start"],
        cursor_position=int(state["cursor_position"]),
        cursor_token=int(state["cursor_token"]),
        depth_done=int(state["depth_done"]),
        filled=bool(state["filled"]),
        finished=bool(state["finished"]),
    )
