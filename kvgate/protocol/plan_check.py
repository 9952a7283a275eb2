"""Whole-plan validation before anything changes: replay the plan's actions on a shadow.

The shadow follows the executed order (free → swap_out → export → adopt → new_requests →
swap_in → block_appends → rows) so that, e.g., a swap-in of a request swapped out in the same
plan is judged correctly.
A plan that passes cannot fail on a bad id, a missing page or a missing input while it runs.

Every executor, real or simulated, validates with this one class: it sees a held request only
through :class:`RequestView` (what the executor has done for it so far), so the rules cannot
drift between executors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.protocol.capacity import length_problem
from kvgate.protocol.step import (
    DecodeRows,
    ErrorCode,
    NewRequest,
    PrefillRow,
    StepError,
    StepPlan,
)


class PlanError(Exception):
    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None):
        super().__init__(message)
        self.error = StepError(code=code, message=message, request_id=request_id)


@dataclass(frozen=True)
class Geometry:
    num_blocks: int
    block_size: int
    num_loops: int
    vocab_size: int
    max_model_len: int
    host_snapshot_blocks: int
    structured_outputs: bool = False  # it can mask by a grammar (ExecutorInfo's flag)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What an executor has done for one held request, as far as validation needs to know.

    ``frontier[d - 1]``: fill positions ``[fill_start, frontier[d - 1])`` are done at plane
    ``d`` (None: no row yet); ``wavefront``: ``(token_start, depth) -> token_end`` of chunks
    waiting for their next depth; ``cursor``: ``(position, depth)`` of the next decode pass, set
    once the fill completed.
    """

    fill_len: int
    prompt_len: int
    frontier: Sequence[int | None]  # read only; the shadow copies it
    fill_start: int | None
    wavefront: Mapping[tuple[int, int], int]
    cursor: tuple[int, int] | None
    finished: bool
    tables: list[list[int]]  # [plane][page] block ids; empty while swapped out


class HeldRequest(Protocol):
    """A resident request of an executor."""

    @property
    def num_pages(self) -> int: ...

    def plan_view(self) -> RequestView: ...


class HeldSnapshot(Protocol):
    """A swapped-out request of an executor: ``num_pages`` pages per plane on the host."""

    @property
    def num_pages(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def plan_view(self) -> RequestView: ...


@dataclass
class _Shadow:
    """What the plan will have done to one request."""

    fill_len: int
    prompt_len: int
    pages: int
    frontier: list[int | None]
    fill_start: int | None
    wavefront: dict[tuple[int, int], int]  # (token_start, depth) -> token_end
    cursor: tuple[int, int] | None  # (position, depth) of the next decode pass
    finished: bool
    fill_completed: bool = False
    tables: list[list[int]] = field(default_factory=list)  # the request's tables before the plan
    _block_ids: set[int] | None = None

    @property
    def block_ids(self) -> set[int]:
        """Every block id in the request's tables (computed only when a plan adds blocks)."""
        if self._block_ids is None:
            self._block_ids = {b for table in self.tables for b in table}
        return self._block_ids

    @block_ids.setter
    def block_ids(self, ids: set[int]) -> None:
        self._block_ids = ids

    @classmethod
    def of(cls, view: RequestView, pages: int) -> _Shadow:
        return cls(
            fill_len=view.fill_len,
            prompt_len=view.prompt_len,
            pages=pages,
            frontier=list(view.frontier),
            fill_start=view.fill_start,
            wavefront=dict(view.wavefront),
            cursor=view.cursor,
            finished=view.finished,
            tables=view.tables,
        )


def _check_new_request(request: NewRequest, geo: Geometry) -> None:
    rid = request.request_id
    sampling = request.sampling
    tokens = [
        *request.prompt_token_ids,
        *request.output_token_ids,
        *sampling.logit_bias,
        *sampling.stop_token_ids,
    ]
    if max(tokens) >= geo.vocab_size:
        raise PlanError(
            ErrorCode.BAD_PLAN, f"token id {max(tokens)} >= vocab size {geo.vocab_size}", rid
        )
    if sampling.grammar is not None and not geo.structured_outputs:
        raise PlanError(ErrorCode.BAD_PLAN, "this executor cannot enforce a grammar", rid)
    problem = length_problem(
        len(request.prompt_token_ids), request.sampling.max_tokens, geo.max_model_len
    )
    if problem is not None:
        raise PlanError(ErrorCode.BAD_PLAN, problem, rid)
    if any(d > geo.num_loops for d in request.exit_depths):
        raise PlanError(ErrorCode.BAD_PLAN, f"exit depth above num_loops {geo.num_loops}", rid)


class PlanValidator:
    def __init__(
        self,
        geo: Geometry,
        resident: Mapping[str, HeldRequest],
        snapshots: Mapping[str, HeldSnapshot],
        staged: Mapping[str, HeldSnapshot] | None = None,
    ):
        self.geo = geo
        self.resident: dict[str, _Shadow] = {}
        self._states = resident
        self.swapped: dict[str, HeldSnapshot | None] = dict(snapshots)
        self.host_blocks = sum(s.num_blocks for s in snapshots.values())
        self._live = set(resident)
        self._staged = staged or {}  # ticket -> a fetched snapshot waiting for its adopt

    def _shadow(self, rid: str) -> _Shadow:
        """The resident request's shadow, created on first use."""
        if rid not in self.resident:
            held = self._states[rid]
            self.resident[rid] = _Shadow.of(held.plan_view(), held.num_pages)
        return self.resident[rid]

    def _is_resident(self, rid: str) -> bool:
        return rid in self._live

    def _check_blocks(
        self, rid: str, tables: list[list[int]], shadow_ids: set[int], what: str
    ) -> set[int]:
        if len(tables) != self.geo.num_loops:
            raise PlanError(
                ErrorCode.BAD_PLAN,
                f"{what} has {len(tables)} planes, the model has {self.geo.num_loops}",
                rid,
            )
        if len({len(t) for t in tables}) > 1:
            raise PlanError(ErrorCode.BAD_PLAN, f"{what} gives planes different page counts", rid)
        ids = [b for t in tables for b in t]
        bad = [b for b in ids if b >= self.geo.num_blocks]
        if bad:
            raise PlanError(
                ErrorCode.BLOCK_OUT_OF_RANGE,
                f"{what}: block id {bad[0]} >= num_blocks {self.geo.num_blocks}",
                rid,
            )
        fresh = set(ids)
        if len(fresh) != len(ids) or fresh & shadow_ids:
            raise PlanError(ErrorCode.BAD_PLAN, f"{what} repeats a block id of the request", rid)
        return fresh

    def validate(self, plan: StepPlan) -> None:
        """Raise PlanError naming the first problem of ``plan``; change nothing."""
        for rid in plan.free:
            if self._is_resident(rid):
                self._live.discard(rid)
            elif rid in self.swapped:
                snapshot = self.swapped.pop(rid)
                self.host_blocks -= snapshot.num_blocks if snapshot else 0
            else:
                raise PlanError(ErrorCode.UNKNOWN_REQUEST, f"free of unknown request {rid}", rid)
        for rid in plan.swap_out:
            self._swap_out(rid)
        tickets: set[str] = set()
        for export in plan.export:
            self._export(export.request_id)
            if export.ticket in tickets:
                raise PlanError(ErrorCode.BAD_PLAN, "two exports share a ticket", export.request_id)
            tickets.add(export.ticket)
        for adopt in plan.adopt:
            self._adopt(adopt.request_id, adopt.ticket)
        for request in plan.new_requests:
            rid = request.request_id
            if self._is_resident(rid) or rid in self.swapped:
                raise PlanError(ErrorCode.BAD_PLAN, f"request {rid} is already registered", rid)
            _check_new_request(request, self.geo)
            fill_len = len(request.prompt_token_ids) + max(len(request.output_token_ids) - 1, 0)
            self.resident[rid] = _Shadow(
                fill_len=fill_len,
                prompt_len=len(request.prompt_token_ids),
                pages=0,
                frontier=[None] * self.geo.num_loops,
                fill_start=None,
                wavefront={},
                cursor=None,
                finished=False,
            )
            self._live.add(rid)
        for swap in plan.swap_in:
            self._swap_in(swap.request_id, swap.block_ids)
        for append in plan.block_appends:
            rid = append.request_id
            if not self._is_resident(rid):
                raise PlanError(
                    ErrorCode.UNKNOWN_REQUEST, f"block append for {rid}, not resident", rid
                )
            shadow = self._shadow(rid)
            shadow.block_ids |= self._check_blocks(
                rid, append.new_block_ids, shadow.block_ids, "block append"
            )
            shadow.pages += len(append.new_block_ids[0])
        prefill_ids = {row.request_id for row in plan.prefill_rows}
        for row in plan.prefill_rows:
            self._prefill_row(row)
        self._decode(plan.decode, prefill_ids)

    def _swap_out(self, rid: str) -> None:
        if not self._is_resident(rid):
            raise PlanError(ErrorCode.UNKNOWN_REQUEST, f"swap-out of {rid}, not resident", rid)
        shadow = self._shadow(rid)
        blocks = shadow.pages * self.geo.num_loops
        if self.host_blocks + blocks > self.geo.host_snapshot_blocks:
            raise PlanError(
                ErrorCode.HOST_BUDGET_EXCEEDED,
                f"swap-out of {rid} needs {blocks} host blocks; {self.host_blocks} of "
                f"{self.geo.host_snapshot_blocks} are in use",
                rid,
            )
        self.host_blocks += blocks
        self._live.discard(rid)
        self.swapped[rid] = None  # its state now lives in the shadow

    def _export(self, rid: str) -> None:
        """A request exports at a token boundary: its fill done, no pass of a token begun."""
        if self._is_resident(rid):
            view: _Shadow | RequestView = self._shadow(rid)
            self._live.discard(rid)
        elif rid in self.swapped:
            snapshot = self.swapped.pop(rid)
            view = self.resident[rid] if snapshot is None else snapshot.plan_view()
            self.host_blocks -= (
                snapshot.num_blocks if snapshot else self.resident[rid].pages * self.geo.num_loops
            )
        else:
            raise PlanError(ErrorCode.UNKNOWN_REQUEST, f"export of unknown request {rid}", rid)
        if view.cursor is None or view.cursor[1] != 1 or view.finished or view.wavefront:
            raise PlanError(
                ErrorCode.BAD_PLAN, f"export of {rid}: not at a token boundary of its decode", rid
            )

    def _adopt(self, rid: str, ticket: str) -> None:
        staged = self._staged.get(ticket)
        if staged is None:
            raise PlanError(ErrorCode.MISSING_SNAPSHOT, f"adopt of {rid}: nothing staged", rid)
        if self._is_resident(rid) or rid in self.swapped:
            raise PlanError(ErrorCode.BAD_PLAN, f"adopt of {rid}: already registered", rid)
        if self.host_blocks + staged.num_blocks > self.geo.host_snapshot_blocks:
            raise PlanError(
                ErrorCode.HOST_BUDGET_EXCEEDED,
                f"adopt of {rid} needs {staged.num_blocks} host blocks; {self.host_blocks} of "
                f"{self.geo.host_snapshot_blocks} are in use",
                rid,
            )
        self.host_blocks += staged.num_blocks
        self.swapped[rid] = staged

    def _swap_in(self, rid: str, tables: list[list[int]]) -> None:
        if rid not in self.swapped:
            raise PlanError(ErrorCode.MISSING_SNAPSHOT, f"swap-in of {rid}: no snapshot", rid)
        snapshot = self.swapped.pop(rid)
        if snapshot is not None:
            self.resident[rid] = _Shadow.of(snapshot.plan_view(), snapshot.num_pages)
        shadow = self.resident[rid]
        pages = shadow.pages
        if any(len(t) != pages for t in tables):
            raise PlanError(
                ErrorCode.BAD_PLAN, f"swap-in of {rid} must give {pages} pages per plane", rid
            )
        shadow.block_ids = self._check_blocks(rid, tables, set(), "swap-in")
        self.host_blocks -= pages * self.geo.num_loops
        self._live.add(rid)

    def _prefill_row(self, row: PrefillRow) -> None:
        rid = row.request_id
        if not self._is_resident(rid):
            raise PlanError(ErrorCode.UNKNOWN_REQUEST, f"prefill row for {rid}, not resident", rid)
        shadow = self._shadow(rid)
        where = (
            f"prefill row [{row.token_start}, {row.token_end}) x "
            f"{row.depth_first}..{row.depth_last}"
        )
        if shadow.cursor is not None or shadow.fill_completed:
            raise PlanError(ErrorCode.BAD_PLAN, f"{where}: the fill of {rid} is complete", rid)
        if row.depth_last > self.geo.num_loops:
            raise PlanError(
                ErrorCode.BAD_PLAN, f"{where}: model has {self.geo.num_loops} loops", rid
            )
        if row.token_end > shadow.fill_len:
            raise PlanError(
                ErrorCode.BAD_PLAN, f"{where}: the fill has {shadow.fill_len} positions", rid
            )
        if row.token_end > shadow.pages * self.geo.block_size:
            raise PlanError(
                ErrorCode.BAD_PLAN, f"{where}: only {shadow.pages} pages are allocated", rid
            )
        if shadow.fill_start is None:
            # The first row may start after a cached prefix, which must fill whole blocks.
            if row.depth_first != 1 or row.token_start % self.geo.block_size:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"{where}: a fill starts at depth 1 on a block boundary",
                    rid,
                )
            shadow.fill_start = row.token_start
            shadow.frontier = [row.token_start] * self.geo.num_loops
        for depth in range(row.depth_first, row.depth_last + 1):
            done = shadow.frontier[depth - 1]
            if done != row.token_start:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"{where}: plane {depth} is filled up to {done}, not {row.token_start}",
                    rid,
                )
            shadow.frontier[depth - 1] = row.token_end
        if row.depth_first > 1:
            key = (row.token_start, row.depth_first - 1)
            if shadow.wavefront.pop(key, None) != row.token_end:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"{where}: no saved depth-{row.depth_first - 1} output of this range",
                    rid,
                )
        if row.depth_last < self.geo.num_loops:
            shadow.wavefront[(row.token_start, row.depth_last)] = row.token_end
        if row.completes_fill:
            if any(f != shadow.fill_len for f in shadow.frontier):
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"{where}: completes_fill but planes are not all filled",
                    rid,
                )
            shadow.fill_completed = True

    def _decode(self, decode: DecodeRows, prefill_ids: set[str]) -> None:
        seen: set[str] = set()
        for rid, position, depth in zip(
            decode.request_ids, decode.positions, decode.depths, strict=True
        ):
            if not self._is_resident(rid):
                raise PlanError(
                    ErrorCode.UNKNOWN_REQUEST, f"decode row for {rid}, not resident", rid
                )
            if rid in seen or rid in prefill_ids:
                raise PlanError(ErrorCode.BAD_PLAN, f"{rid} has more than one row in the step", rid)
            seen.add(rid)
            shadow = self.resident.get(rid)
            if shadow is None:  # nothing else in the plan touched it: read it, no shadow made
                held = self._states[rid]
                view = held.plan_view()
                expected, finished, pages = view.cursor, view.finished, held.num_pages
            else:
                expected, finished, pages = shadow.cursor, shadow.finished, shadow.pages
            if expected is None:
                raise PlanError(ErrorCode.BAD_PLAN, f"decode row for {rid} before its fill", rid)
            if finished:
                continue  # skipped, not an error: the plan was made before the finish was known
            if position is not None and position != expected[0]:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"decode row for {rid} at position {position}, the cursor is at {expected[0]}",
                    rid,
                )
            if depth is not None and depth != expected[1]:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"decode row for {rid} at depth {depth}, the cursor is at {expected[1]}",
                    rid,
                )
            if expected[0] >= pages * self.geo.block_size:
                raise PlanError(
                    ErrorCode.BAD_PLAN,
                    f"decode row for {rid} at position {expected[0]} beyond its {pages} pages",
                    rid,
                )
