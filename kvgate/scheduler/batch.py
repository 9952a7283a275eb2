"""Row selection: which running requests get a row in this step, under the token budget.

Running requests are visited in admission order, so the most important ones claim budget and
blocks first. A row that needs a new block and finds none preempts the least important eligible
running request (never one already selected in this step, never one started in this step, never
one inside its residency window unless the requester is of a strictly more important class); if no
such set of victims can free enough, the requester yields this step and nothing is evicted.

The budget counts token *passes*: a decode row is one, a wavefront task is its chunk length, a
non-wavefront prefill row is its chunk length times the loop depth.

``refill`` mode gives a step prefill rows or decode rows (a decode step is due after
``max_prefill_steps_before_decode`` prefill steps); ``mixed`` mode puts both in one forward.

The background class (``background_priority``) comes last in admission order. While a more
important request runs or waits, the background's rows share at most ``background_step_tokens``
passes, kept for it from a budget of at least twice that (so a step an interactive request's
first token waits for is lengthened by at most that much background work, and a running
background request still gets a row: its progress is bounded); with nothing else to run they
get the whole budget. Under wavefront prefill a background fill's chunks are cut to that cap, so
a chunk begun without it (its later depths are the same size) still fits under it.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from kvgate.scheduler.config import Mode
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import background_key, is_background
from kvgate.scheduler.request import Request, RequestStatus
from kvgate.scheduler.state import SchedulerState


class RoomMaker(Protocol):
    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool: ...


class _Stage(Enum):
    FILL = "fill"
    DECODE = "decode"


def select_rows(state: SchedulerState, builder: PlanBuilder, rooms: RoomMaker) -> None:
    budget = state.config.max_num_batched_tokens
    if state.config.mode is Mode.MIXED:
        _visit(state, builder, rooms, budget, stage=None)
        return
    stage = _due_stage(state)
    budget = _visit(state, builder, rooms, budget, stage=stage)
    if builder.num_rows == 0:  # the due stage had nothing runnable: do not waste the step
        other = _Stage.DECODE if stage is _Stage.FILL else _Stage.FILL
        _visit(state, builder, rooms, budget, stage=other)
    if builder.decode_ids:
        state.prefill_steps_since_decode = 0
    elif builder.prefill_rows:
        state.prefill_steps_since_decode += 1


def _due_stage(state: SchedulerState) -> _Stage:
    has_fill = has_decode = False
    for request in state.running:
        if request.fill is not None and not _fill_completion_in_flight(state, request):
            has_fill = True
        else:
            has_decode = True
        if has_fill and has_decode:
            break
    if not has_decode:
        return _Stage.FILL
    if not has_fill:
        return _Stage.DECODE
    decode_due = state.prefill_steps_since_decode >= state.config.max_prefill_steps_before_decode
    return _Stage.DECODE if decode_due else _Stage.FILL


def _visit(
    state: SchedulerState,
    builder: PlanBuilder,
    rooms: RoomMaker,
    budget: int,
    *,
    stage: _Stage | None,
) -> int:
    """Give rows to running requests in admission order, the background's capped while other
    work is present; ``stage`` None admits both kinds."""
    running = state.running.snapshot()
    split = _capped_from(state, builder, running)
    if split == len(running):
        return _visit_rows(state, builder, rooms, running, budget, stage)
    cap = state.config.background_step_tokens
    if budget >= 2 * cap:
        # The background's passes are kept from the rest (as many as it can use, a pass for a
        # decode row): a running background request advances even when the other work could
        # fill the step, and a pass it cannot use is not taken from the others.
        share = min(cap, sum(cap if r.fill is not None else 1 for r in running[split:]))
        budget = _visit_rows(state, builder, rooms, running[:split], budget - share, stage)
        return budget + _visit_rows(state, builder, rooms, running[split:], share, stage)
    # A budget under twice the cap (never at the defaults) keeps nothing for the background.
    budget = _visit_rows(state, builder, rooms, running[:split], budget, stage)
    share = min(budget, cap)
    return budget - share + _visit_rows(state, builder, rooms, running[split:], share, stage)


def _capped_from(state: SchedulerState, builder: PlanBuilder, running: list[Request]) -> int:
    """Index in ``running`` (admission order) of the first background request whose rows are
    capped in this step; ``len(running)`` when none is."""
    start = background_key(state.config)
    if start is None:
        return len(running)
    split = state.running.count_below(start)
    if split == 0 and not builder.foreground_waiting:
        return len(running)  # only background work: it has the step to itself
    return split


def _visit_rows(
    state: SchedulerState,
    builder: PlanBuilder,
    rooms: RoomMaker,
    requests: list[Request],
    budget: int,
    stage: _Stage | None,
) -> int:
    pool = state.pool
    block_size = pool.block_size
    step = state.step
    ids, positions, depths = builder.decode_ids, builder.decode_positions, builder.decode_depths
    selected = builder.selected
    # Read once: an enum member lookup costs as much as the rest of a lean decode row.
    running = RequestStatus.RUNNING
    visit_fills, visit_decodes = stage is not _Stage.DECODE, stage is not _Stage.FILL
    for request in requests:
        if budget <= 0:
            break
        if request.status is not running:
            continue  # evicted by an earlier row's growth in this step
        if request.fill is not None and not _fill_completion_in_flight(state, request):
            if visit_fills:
                budget = _schedule_fill(state, builder, rooms, request, budget)
            continue
        if not visit_decodes:
            continue
        # The common cases, kept lean (a missing page with none free goes on to the general
        # path, which may preempt for it): the row's position, depth and K/V frontier.
        depth = 0  # 0: the general path
        if request.inflight_step is None:  # resolved: the cursor is known
            position = request.prompt_len + len(request.output_token_ids) - 1
            depth = request.depth_done + 1
            frontier = position + 1
        elif (
            request.inflight_decode
            and request.fill is None
            and request.inflight_step < step
            and request.depth_done + 1 >= request.max_loops
        ):
            # Async scheduling: its pass in flight surely ends its token (the last depth), so
            # the next feeds that token at the next position (``next_decode_pass``'s certain
            # exit), unless that token is its last.
            outputs = len(request.output_token_ids)
            if request.stop.length_reached(outputs + 1):
                continue
            position = request.prompt_len + outputs
            depth = 1
            frontier = min(position + 1, request.capacity_tokens)
        if depth:
            request_id = request.request_id
            pages = -(-frontier // block_size)  # the table must cover [0, frontier)
            if pages <= pool.num_pages(request_id) or _take_free_pages(
                state, builder, request, pages
            ):
                ids.append(request_id)
                positions.append(position)
                depths.append(depth)
                selected.add(request_id)
                request.inflight_step = step
                request.inflight_decode = True
                request.inflight_completes_fill = False
                budget -= 1
                continue
        budget = _schedule_decode(state, builder, rooms, request, budget)
    return budget


def _fill_completion_in_flight(state: SchedulerState, request: Request) -> bool:
    return state.unresolved(request) and request.inflight_completes_fill


def _mark_inflight(
    state: SchedulerState, request: Request, *, decode: bool, completes: bool
) -> None:
    if request.inflight_step != state.step:
        request.inflight_step = state.step
        request.inflight_decode = False
        request.inflight_completes_fill = False
    request.inflight_decode |= decode
    request.inflight_completes_fill |= completes


# --- prefill ---------------------------------------------------------------------------------
def _schedule_fill(
    state: SchedulerState, builder: PlanBuilder, rooms: RoomMaker, request: Request, budget: int
) -> int:
    fill = request.fill
    assert fill is not None
    chunk_size = state.config.prefill_chunk_size
    if fill.wavefront and is_background(state.config, request):
        chunk_size = min(chunk_size, state.config.background_step_tokens)
    for task in fill.ready_tasks():
        per_token = task.cost_per_token
        if task.chunk is None:
            num_tokens = min(task.max_tokens, chunk_size, budget // per_token)
        else:
            num_tokens = task.max_tokens
            if num_tokens * per_token > budget:
                continue
        if num_tokens <= 0:
            continue
        if not _ensure_pages(state, builder, rooms, request, task.start + num_tokens):
            break
        chunk, completes = fill.schedule(task, num_tokens)
        builder.add_prefill(
            request.request_id, chunk.start, chunk.end, task.depth_first, task.depth_last, completes
        )
        _mark_inflight(state, request, decode=False, completes=completes)
        budget -= num_tokens * per_token
    return budget


# --- decode ----------------------------------------------------------------------------------
def _certain_exit(request: Request, depth: int) -> bool | None:
    """Whether the pass at ``depth`` surely ends its token (``None``: the executor decides)."""
    if depth >= request.max_loops:
        return True
    trace = request.spec.loops.exit_trace
    index = len(request.output_token_ids)
    if trace is not None and index < len(trace):
        return depth == trace[index]
    if depth < request.min_loops:
        return False
    return None


def next_decode_pass(
    state: SchedulerState, request: Request
) -> tuple[int | None, int | None, int] | None:
    """(position, depth, K/V frontier in tokens) of the request's next pass; position and depth
    are ``None`` when an in-flight outcome decides them. ``None``: no pass is useful now."""
    stop = request.stop
    if request.fill is not None:
        # Only reached while the fill's last row is in flight: decode starts right after it.
        # A fresh fill's last row samples the first output (a recompute's samples nothing).
        if not request.output_token_ids and stop.length_reached(1):
            return None
        position = request.fill.length
        return position, 1, position + 1
    position = request.cursor_position
    depth = request.depth_done + 1
    if not (state.unresolved(request) and request.inflight_decode):
        return position, depth, position + 1
    # The pass (position, depth) is in flight: what follows depends on whether it exits, and
    # whether the token it may produce is the last (only its count is known before it exists).
    finishes_on_exit = stop.length_reached(len(request.output_token_ids) + 1)
    exits = _certain_exit(request, depth)
    if exits is True:
        return None if finishes_on_exit else (position + 1, 1, position + 2)
    if exits is False:
        return position, depth + 1, position + 1
    return None, None, position + (1 if finishes_on_exit else 2)


def _schedule_decode(
    state: SchedulerState, builder: PlanBuilder, rooms: RoomMaker, request: Request, budget: int
) -> int:
    nxt = next_decode_pass(state, request)
    if nxt is None:
        return budget
    position, depth, frontier = nxt
    if not _ensure_pages(state, builder, rooms, request, frontier):
        return budget
    builder.add_decode(request.request_id, position, depth)
    _mark_inflight(state, request, decode=True, completes=False)
    return budget - 1


# --- growth ----------------------------------------------------------------------------------
def _ensure_pages(
    state: SchedulerState,
    builder: PlanBuilder,
    rooms: RoomMaker,
    request: Request,
    frontier_tokens: int,
) -> bool:
    """Make the table cover ``[0, frontier_tokens)``, preempting for it if that helps."""
    pool = state.pool
    frontier_tokens = min(frontier_tokens, request.capacity_tokens)
    pages = pool.pages_for(frontier_tokens)
    have = pool.num_pages(request.request_id)
    if pages <= have or _take_free_pages(state, builder, request, pages):
        return True
    short = (pages - have) * state.num_planes - pool.num_free_blocks
    if not rooms.make_room(state, builder, request, short):
        return False
    # False only for a strategy without a preflight.
    return _take_free_pages(state, builder, request, pages)


def _take_free_pages(
    state: SchedulerState, builder: PlanBuilder, request: Request, num_pages: int
) -> bool:
    """Grow the table to ``num_pages`` from free blocks alone; False (nothing changed) when
    they do not cover it."""
    fresh = state.grow(request, num_pages)
    if fresh is None:
        return False
    builder.append_pages(request.request_id, fresh)
    return True
