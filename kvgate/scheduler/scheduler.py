"""The scheduler: ``schedule(now) -> StepPlan | None`` and ``apply(result) -> events``.

Both are deterministic functions of the scheduler's state and their inputs; time is passed in.
A step is three named phases — admit, select rows, freeze the plan — and applying a result is
the only place where progress advances.

Async scheduling: with ``async_scheduling`` one plan may be in flight while the next is planned
(``schedule`` twice, then ``apply`` the older result). Without it, every plan must be applied
before the next ``schedule``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence

from kvgate.protocol.capacity import blocks_for, length_problem, positions_needed
from kvgate.protocol.enums import FinishReason, RestoreMode
from kvgate.protocol.step import SnapshotAdopt, SnapshotExport, StepPlan, StepResult
from kvgate.protocol.stopping import StopRule
from kvgate.protocol.tenants import DEFAULT_TENANT
from kvgate.scheduler import invariants
from kvgate.scheduler.config import CacheConfig, Fairness, ModelShape, SchedulerConfig
from kvgate.scheduler.errors import (
    PlanRejected,
    RequestRejected,
    SchedulerStalled,
)
from kvgate.scheduler.events import (
    FinishedEvent,
    PromptLogprobsEvent,
    RequestEvent,
    RequestStats,
    StepReport,
    TokenEvent,
)
from kvgate.scheduler.fairness import FairWaitingQueue, TenantClock
from kvgate.scheduler.kv import BlockPool, page_hashes
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import Ordering, priority_class
from kvgate.scheduler.request import (
    ImportedSnapshot,
    Request,
    RequestProgress,
    RequestSpec,
    RequestStatus,
)
from kvgate.scheduler.state import SchedulerState, WaitingQueue
from kvgate.scheduler.strategy import KvgateStrategy, Strategy


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        model: ModelShape,
        strategy: Strategy | None = None,
    ) -> None:
        if not config.wavefront_prefill and config.max_num_batched_tokens < model.num_loops:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) cannot hold one "
                f"prefill token at every one of {model.num_loops} loops; raise it or enable "
                "wavefront_prefill"
            )
        if not config.wavefront_prefill and config.background_step_tokens < model.num_loops:
            # The background's share holds at least one prefill token at every loop, or a
            # background fill could not advance beside other work (documented floor).
            config = config.model_copy(update={"background_step_tokens": model.num_loops})
        pool = BlockPool(
            cache.num_blocks, cache.block_size, model.num_loops, cache.enable_prefix_caching
        )
        self.ordering = Ordering.of(config)
        waiting = WaitingQueue()
        if config.fairness is not Fairness.OFF:
            clock = TenantClock(
                config.tenant_weights, config.default_tenant_weight, config.fair_burst_tokens
            )
            waiting = FairWaitingQueue(self.ordering, clock)
        self.state = SchedulerState(
            config=config, cache=cache, model=model, pool=pool, waiting=waiting
        )
        self.strategy: Strategy = strategy or KvgateStrategy()
        self.last_report = StepReport(step_id=0)
        self._events: list[RequestEvent] = []
        self._finished_count = 0
        self._progressed = False

    # --- requests ----------------------------------------------------------------------------
    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    def add_request(
        self,
        spec: RequestSpec,
        *,
        arrival_seq: int | None = None,
        progress: RequestProgress | None = None,
        snapshot: ImportedSnapshot | None = None,
        now: float | None = None,
    ) -> Request:
        """Queue a request, or raise ``RequestRejected`` if it can never run here.

        With ``snapshot`` (a migration; ``progress`` required) it waits as a request preempted
        with a host snapshot: the next plan adopts the staged KV, and admission restores it by
        swap-in like any other snapshot — or it is rejected when the host budget has no room.

        ``now`` (default: the time the last step was planned at) is its arrival time, which
        orders it under deadline order when it has no deadline of its own; a request that
        moved keeps the ordering deadline it had (``progress.order_deadline_s``)."""
        state = self.state
        if spec.request_id in state.requests:
            raise RequestRejected(spec.request_id, "a request with this id is already in flight")
        check_feasible(self.state, spec)
        if snapshot is not None:
            blocks = snapshot.num_pages * state.num_planes
            if progress is None or not progress.output_token_ids:
                raise ValueError("a migrated snapshot comes with the request's progress")
            if state.host_blocks_used + blocks > state.cache.host_snapshot_blocks:
                raise RequestRejected(
                    spec.request_id,
                    f"no host room for its {blocks} snapshot blocks ({state.host_blocks_used} "
                    f"of {state.cache.host_snapshot_blocks} in use)",
                )
        if progress is not None:
            arrival_seq = progress.arrival_seq
        seq = state.next_arrival_seq if arrival_seq is None else arrival_seq
        state.next_arrival_seq = max(state.next_arrival_seq, seq + 1)
        loops = spec.loops
        num_loops = state.model.num_loops
        request = Request(
            spec=spec,
            request_id=spec.request_id,
            key=(),
            priority_class=priority_class(state.config.policy, spec.priority),
            arrival_seq=seq,
            num_loops=num_loops,
            min_loops=min(loops.min_loops, num_loops),
            max_loops=min(loops.max_loops or num_loops, num_loops),
            capacity_tokens=positions_needed(len(spec.prompt_token_ids), spec.sampling.max_tokens),
            stop=StopRule.of(spec.sampling, state.model.eos_token_id),
            prompt_len=len(spec.prompt_token_ids),
            arrival_step=state.step,
            tenant=spec.tenant or DEFAULT_TENANT,
            order_deadline_s=_order_deadline(state, spec, progress, now),
        )
        request.key = self.ordering.key(request)
        if state.cache.enable_prefix_caching and spec.sampling.prompt_logprobs is None:
            # A request scoring its prompt computes every prompt position: it neither takes
            # pages from the cache (their positions would have no logits) nor offers any.
            request.page_digests = page_hashes(spec.prompt_token_ids, state.cache.block_size)
        if progress is not None:
            request.output_token_ids = list(progress.output_token_ids)
            request.exit_depths = list(progress.exit_depths)
            request.bypasses = progress.bypasses
            request.num_preemptions = progress.preemptions
            request.kv_tokens_lost = progress.kv_tokens
        if snapshot is not None:
            request.kv_tokens_lost = 0
            request.restore_mode = RestoreMode.SNAPSHOT
            request.snapshot_pages = snapshot.num_pages
            request.on_executor = True
            state.host_blocks_used += snapshot.num_pages * state.num_planes
            state.pending_adopts.append(
                SnapshotAdopt.model_construct(request_id=spec.request_id, ticket=snapshot.ticket)
            )
        request.progress_mark = request.kv_frontier
        state.requests[spec.request_id] = request
        state.waiting.push(request)
        if spec.deadline_s is not None:
            heapq.heappush(state.deadlines, (spec.deadline_s, seq, spec.request_id))
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Cancel a request; its final event comes with the next ``apply``/``pop_events``."""
        request = self.state.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason)
        return True

    def expire(self, now: float) -> None:
        """Finish every request whose deadline has passed."""
        deadlines = self.state.deadlines
        while deadlines and deadlines[0][0] <= now:
            _, seq, request_id = heapq.heappop(deadlines)
            request = self.state.requests.get(request_id)
            if request is not None and request.arrival_seq == seq:
                self._finish(request, FinishReason.DEADLINE)

    def pop_events(self) -> list[RequestEvent]:
        events, self._events = self._events, []
        return events

    def migratable(self) -> list[str]:
        """Requests whose KV can move to another executor now: at a token boundary of their
        decode (fill done, no pass of the next token begun, no rows in flight), resident or
        preempted with a host snapshot; not one whose own adopt is still unsent."""
        adopting = {a.request_id for a in self.state.pending_adopts}
        return [
            request.request_id
            for request in sorted(self.state.requests.values(), key=lambda r: r.key)
            if request.on_executor
            and request.output_token_ids
            and request.fill is None
            and request.depth_done == 0
            and request.inflight_step is None
            and request.request_id not in adopting
            and (
                request.status is RequestStatus.RUNNING
                or request.restore_mode is RestoreMode.SNAPSHOT
            )
        ]

    def evacuate(
        self,
        *,
        executor_alive: bool,
        exports: Mapping[str, str] | None = None,
        export_ttl_s: float = 30.0,
    ) -> list[RequestProgress]:
        """Lift every request out (executor lost or drained) to resume elsewhere.

        With a live executor the next plan frees their state there — or, for the requests in
        ``exports`` (request id -> ticket, from ``migratable()``), exports their KV under the
        ticket for another executor to fetch; their progress carries ``snapshot_pages``."""
        state = self.state
        exports = exports if executor_alive and exports else {}
        adopting = {a.request_id for a in state.pending_adopts}
        lifted: list[RequestProgress] = []
        for request in sorted(state.requests.values(), key=lambda r: r.key):
            rid = request.request_id
            exported = rid in exports
            if exported:
                pages = (
                    state.pool.num_pages(rid)
                    if request.status is RequestStatus.RUNNING
                    else request.snapshot_pages
                )
                state.pending_exports.append(
                    SnapshotExport.model_construct(
                        request_id=rid, ticket=exports[rid], ttl_s=export_ttl_s
                    )
                )
            lifted.append(
                RequestProgress(
                    spec=request.spec,
                    output_token_ids=tuple(request.output_token_ids),
                    exit_depths=tuple(request.exit_depths),
                    arrival_seq=request.arrival_seq,
                    bypasses=request.bypasses,
                    preemptions=request.num_preemptions,
                    kv_tokens=request.kv_frontier if request.on_executor else 0,
                    snapshot_pages=pages if exported else 0,
                    order_deadline_s=request.order_deadline_s,
                )
            )
            if request.status is RequestStatus.RUNNING:
                state.release_blocks(request)
                state.running.remove(request)
            else:
                state.waiting.discard(request)
            if executor_alive and request.on_executor and not exported and rid not in adopting:
                state.pending_free.append(rid)
            request.status = RequestStatus.FINISHED
        state.requests.clear()
        state.host_blocks_used = 0
        state.inflight.clear()
        state.pending_adopts.clear()
        if not executor_alive:
            state.pending_free.clear()
            state.pending_exports.clear()
        return lifted

    def withdraw(self, request_id: str) -> RequestProgress | None:
        """Lift out a request that waits here without having started (never admitted here, no
        state on the executor), to be queued on another scheduler with ``add_request(progress=
        ...)``: it keeps its arrival number, bypass count and ordering deadline, so it keeps its
        place and its bypass protection. ``None`` when it is not such a request."""
        state = self.state
        request = state.requests.get(request_id)
        if (
            request is None
            or request.status is not RequestStatus.WAITING
            or request.keyed
            or request.on_executor
            or request.restore_mode is not None
        ):
            return None
        state.waiting.discard(request)
        del state.requests[request_id]
        request.status = RequestStatus.FINISHED
        return RequestProgress(
            spec=request.spec,
            output_token_ids=tuple(request.output_token_ids),
            exit_depths=tuple(request.exit_depths),
            arrival_seq=request.arrival_seq,
            bypasses=request.bypasses,
            preemptions=request.num_preemptions,
            kv_tokens=request.kv_tokens_lost,
            order_deadline_s=request.order_deadline_s,
        )

    # --- views -------------------------------------------------------------------------------
    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        """Leading pages of a prompt (``kv.page_hashes`` at this cache's block size) that the
        prefix cache holds now: placement's probe, which changes nothing."""
        return self.state.pool.cached_prefix_pages(digests)

    def host_room_for(self, num_pages: int) -> bool:
        """Whether a snapshot of ``num_pages`` pages per plane fits the host budget now."""
        state = self.state
        blocks = num_pages * state.num_planes
        return state.host_blocks_used + blocks <= state.cache.host_snapshot_blocks

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting)

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def has_work(self) -> bool:
        state = self.state
        return bool(
            state.requests or state.pending_free or state.pending_exports or state.pending_adopts
        )

    @property
    def num_inflight(self) -> int:
        return len(self.state.inflight)

    def waiting_order(self, limit: int | None = None) -> list[Request]:
        return self.state.waiting.ordered(limit)

    def check_invariants(self) -> None:
        invariants.check(self.state, self.last_report)

    def invariant_violations(self) -> dict[invariants.Invariant, list[str]]:
        """What ``check_invariants`` would raise, by invariant (empty when all hold)."""
        return invariants.violations(self.state, self.last_report)

    # --- the step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan | None:
        state = self.state
        allowed = 2 if state.config.async_scheduling else 1
        if len(state.inflight) >= allowed:
            raise RuntimeError(f"{len(state.inflight)} plan(s) in flight; apply results first")
        if state.steps_without_progress >= state.config.stall_steps:
            raise SchedulerStalled(
                f"no request progressed for {state.steps_without_progress} steps with "
                f"{len(state.waiting)} waiting and {len(state.running)} running",
                invariants.dump(state),
            )
        state.now = now
        self.expire(now)
        state.step += 1
        builder = PlanBuilder(state.step, state.num_planes)
        builder.free.extend(state.pending_free)
        state.pending_free.clear()
        builder.export.extend(state.pending_exports)
        state.pending_exports.clear()
        builder.adopt.extend(state.pending_adopts)
        state.pending_adopts.clear()
        self.strategy.plan_step(state, builder)
        self._report(builder)
        if builder.is_empty():
            # The step still counts: residency windows and other step-measured waits must run
            # out while nothing can be planned, or a wait on them would never end.
            if state.requests and not state.inflight:
                state.steps_without_progress += 1  # work exists, nothing can run
            return None
        plan = builder.build()
        state.inflight[plan.step_id] = plan
        return plan

    def _report(self, builder: PlanBuilder) -> None:
        state = self.state
        report = builder.report
        report.decode_rows = len(builder.decode_ids)
        report.rows = report.decode_rows + len(builder.prefill_rows)
        # Counted over the whole list (``None``: decided by an in-flight outcome), then dropped.
        depths: Counter[int | None] = Counter(builder.decode_depths)
        for row in builder.prefill_rows:
            report.prefill_tokens += (row.token_end - row.token_start) * (
                row.depth_last - row.depth_first + 1
            )
            depths.update(range(row.depth_first, row.depth_last + 1))
        report.depths = {depth: rows for depth, rows in depths.items() if depth is not None}
        report.blocks_free = state.pool.num_free_blocks
        report.blocks_used = state.pool.num_used_blocks
        report.num_waiting = len(state.waiting)
        report.num_running = len(state.running)
        report.progressed_request_ids = builder.selected | builder.started
        report.bypass_limit = state.config.max_admission_bypasses
        requests = state.requests
        report.max_bypasses = max(
            (requests[r].bypasses for r in report.bypassed if r in requests), default=0
        )
        self.last_report = report

    def apply(self, result: StepResult) -> list[RequestEvent]:
        """Advance progress by an executor's result (results arrive in plan order)."""
        state = self.state
        if not state.inflight:
            raise RuntimeError(f"result for step {result.step_id} but no plan is in flight")
        oldest = min(state.inflight)
        if result.step_id != oldest:
            raise RuntimeError(f"result for step {result.step_id}, expected step {oldest}")
        plan = state.inflight.pop(oldest)
        if result.error is not None:
            raise PlanRejected(f"executor rejected step {plan.step_id}: {result.error.message}")
        self._progressed = False
        finished_before = self._finished_count
        self._apply_prefill(plan)
        self._apply_decode(result, plan.step_id)
        for scores in result.prompt_logprobs:
            if scores.request_id in state.requests:
                self._events.append(PromptLogprobsEvent(scores.request_id, scores))
        self._apply_tokens(result)
        requests = state.requests
        state.waiting.refresh(requests[row[0]] for row in result.token_rows() if row[0] in requests)
        self._check_skipped(result)
        # Progress means K/V beyond a request's high-water mark, a new token, or a finish: work
        # redone after a recompute preemption does not count, so a preempt/restore cycle cannot
        # hide a stall.
        if self._progressed or self._finished_count > finished_before:
            state.steps_without_progress = 0
        else:
            state.steps_without_progress += 1
        return self.pop_events()

    def _apply_prefill(self, plan: StepPlan) -> None:
        requests = self.state.requests
        for row in plan.prefill_rows:
            request = requests.get(row.request_id)
            if request is None:
                continue
            if request.inflight_step == plan.step_id:
                request.inflight_step = None
            fill = request.fill
            if fill is None:
                continue  # its fill was dropped by a recompute preemption
            fill.complete(row.token_start, row.depth_last)
            frontier = fill.full_depth_frontier()
            if frontier > request.progress_mark:
                request.progress_mark = frontier
                self._progressed = True
            self._publish_prefix(request)
            if row.completes_fill:
                request.fill = None
                request.depth_done = 0
                self.state.refresh_owed(request)

    def _publish_prefix(self, request: Request) -> None:
        state = self.state
        fill = request.fill
        if not request.page_digests or fill is None or request.status is not RequestStatus.RUNNING:
            return
        ready = fill.full_depth_frontier() // state.cache.block_size
        if ready > request.published_pages:
            state.pool.publish(request.request_id, request.page_digests, ready)
            request.published_pages = min(ready, len(request.page_digests))

    def _apply_decode(self, result: StepResult, step_id: int) -> None:
        requests = self.state.requests
        decode = result.decode
        for request_id, position, depth, exited in zip(
            decode.request_ids, decode.positions, decode.depths, decode.exited, strict=True
        ):
            request = requests.get(request_id)
            if request is None:
                continue
            if request.inflight_step == step_id:
                request.inflight_step = None
            if request.fill is not None or (
                request.restore_mode is not None and not request.on_executor
            ):
                continue  # a recompute preemption dropped it: the unfinished token restarts
            expected = request.prompt_len + len(request.output_token_ids) - 1
            if position != expected or depth != request.depth_done + 1:
                raise PlanRejected(
                    f"{request_id}: executor ran ({position}, {depth}), scheduler expected "
                    f"({expected}, {request.depth_done + 1})"
                )
            request.depth_done = 0 if exited else depth

    def _apply_tokens(self, result: StepResult) -> None:
        requests = self.state.requests
        events = self._events
        if result.num_tokens:
            self._progressed = True  # a token always lies past its request's high-water mark
        for request_id, position, token_id, exit_depth, logprob, top in result.token_rows():
            request = requests.get(request_id)
            if request is None:
                continue
            outputs = request.output_token_ids
            index = len(outputs)  # the new token's output index
            if position != request.prompt_len + index:
                raise PlanRejected(
                    f"{request_id}: token at position {position}, expected "
                    f"{request.prompt_len + index}"
                )
            outputs.append(token_id)
            request.exit_depths.append(exit_depth)
            # The same tuple as ``TokenEvent(...)`` without the generated Python-level ``__new__``
            # (a third of the cost): one is made per running request per step.
            events.append(
                tuple.__new__(
                    TokenEvent,
                    (request_id, index, token_id, exit_depth, logprob, top),
                )
            )
            request.progress_mark = position
            reason = request.stop.finish_reason(index + 1, token_id)
            if reason is not None:
                self._finish(request, reason)

    def _check_skipped(self, result: StepResult) -> None:
        for request_id in result.skipped_request_ids:
            if request_id in self.state.requests:
                raise PlanRejected(f"executor skipped {request_id}, which has not finished")

    def _finish(self, request: Request, reason: FinishReason) -> None:
        state = self.state
        if request.status is RequestStatus.RUNNING:
            state.release_blocks(request)
            state.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            state.waiting.discard(request)
            state.host_blocks_used -= request.snapshot_pages * state.num_planes
            request.snapshot_pages = 0
        adopts = state.pending_adopts
        if any(a.request_id == request.request_id for a in adopts):
            # Never adopted: the staged import expires on the executor by itself.
            state.pending_adopts = [a for a in adopts if a.request_id != request.request_id]
        elif request.on_executor:
            state.pending_free.append(request.request_id)
        state.waiting.settle(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del state.requests[request.request_id]
        self._finished_count += 1
        self._events.append(
            FinishedEvent(
                request_id=request.request_id,
                reason=reason,
                output_token_ids=tuple(request.output_token_ids),
                exit_depths=tuple(request.exit_depths),
                stats=RequestStats(
                    preemptions=request.num_preemptions,
                    restores=len(request.restore_modes),
                    restore_modes=tuple(request.restore_modes),
                    bypasses=request.bypasses,
                    recomputed_tokens=request.recomputed_tokens,
                    arrival_step=request.arrival_step,
                    first_admitted_step=request.first_admitted_step,
                    finished_step=state.step,
                ),
            )
        )


def _order_deadline(
    state: SchedulerState,
    spec: RequestSpec,
    progress: RequestProgress | None,
    now: float | None,
) -> float:
    """Its deadline for deadline order: kept from where it came from, else its own, else its
    arrival plus ``deadline_slack_s`` (so no request waits behind ever-earlier deadlines for
    good: once that time has passed, every request still in time is ordered behind it)."""
    if progress is not None and progress.order_deadline_s is not None:
        return progress.order_deadline_s
    if spec.deadline_s is not None:
        return spec.deadline_s
    arrival_s = state.now if now is None else now
    return arrival_s + state.config.deadline_slack_s


# --- feasibility ----------------------------------------------------------------------------
# Invariant 5, feasibility: a request that cannot fit an empty cache is rejected on arrival with
# a reason, never queued forever. So are requests the model cannot serve (too long, bad loop
# bounds, an exit trace that does not cover the outputs).


def check_feasible(state: SchedulerState, spec: RequestSpec) -> None:
    """Raise ``RequestRejected`` for a request that could never run, even on an empty cache."""
    rid = spec.request_id
    if not spec.prompt_token_ids:
        raise RequestRejected(rid, "the prompt is empty")
    prompt_len, max_tokens = len(spec.prompt_token_ids), spec.sampling.max_tokens
    problem = length_problem(prompt_len, max_tokens, state.model.max_model_len)
    if problem is not None:
        raise RequestRejected(rid, problem)
    capacity = positions_needed(prompt_len, max_tokens)
    blocks = blocks_for(
        prompt_len, max_tokens, block_size=state.cache.block_size, num_planes=state.num_planes
    )
    if blocks > state.cache.num_blocks:
        raise RequestRejected(
            rid,
            f"needs {blocks} KV blocks ({capacity} tokens × {state.num_planes} planes at "
            f"block size {state.cache.block_size}) but the whole cache has "
            f"{state.cache.num_blocks}",
        )
    loops = spec.loops
    if loops.min_loops > state.num_planes:
        raise RequestRejected(
            rid, f"min_loops ({loops.min_loops}) exceeds the model's {state.num_planes} loops"
        )
    if loops.exit_trace is not None:
        _check_trace(state, spec)


def _check_trace(state: SchedulerState, spec: RequestSpec) -> None:
    trace = spec.loops.exit_trace or []
    r = state.num_planes
    top = min(spec.loops.max_loops or r, r)
    if len(trace) < spec.sampling.max_tokens:
        raise RequestRejected(
            spec.request_id,
            f"exit_trace has {len(trace)} depths for max_tokens {spec.sampling.max_tokens}",
        )
    if trace[0] != r:
        raise RequestRejected(
            spec.request_id, f"exit_trace[0] must be the full depth {r} (the prompt's pass)"
        )
    bad = [d for d in trace[1:] if not spec.loops.min_loops <= d <= top]
    if bad:
        raise RequestRejected(
            spec.request_id,
            f"exit_trace depths {bad[:4]} outside [{spec.loops.min_loops}, {top}]",
        )
