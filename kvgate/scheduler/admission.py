"""The one admission loop: fresh admissions, snapshot restores and recompute restores alike.

```
for each waiting request, in admission order, at most admission_scan_limit:
    need ← blocks to start it (fresh: its first chunk, or full capacity when not incremental;
           snapshot restore: its snapshot's pages; recompute restore: its first chunk)
           [+ the rest of its fill and the fill owed to running requests: fill pricing]
           + watermark headroom when other work is active
           + the growth reserve: what running requests ahead of it may grow into within
             growth_reserve_steps steps (the growth reserve, below)
    if it fits, or strictly-less-important running work can free enough (checked first):
        evict that work, start it
        every request deferred earlier in this scan: bypasses += 1
        stop if any of them reached max_admission_bypasses
    else:
        defer; stop if this request's bypasses ≥ max_admission_bypasses
deferred requests keep their place at the front of the waiting order
```

With ``admission_pricing: fill`` (the default) the need also covers the rest of the request's fill
and the fill still owed to running requests, while blocks are still claimed chunk by chunk: this
keeps admission from stranding prompts half-way. On the livelock suite it made 233 preemptions
against ``first_chunk``'s 507 at the same step count before the growth reserve, and 84 against
135 with it (docs/scheduler.md, docs/benchmarks.md). Decode growth beyond
the growth reserve's horizon is left to preemption, as in vLLM.

A request cannot start in the step it was evicted in, nor while results of its last rows are in
flight; it is deferred like any other (so its bypass protection still holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.protocol.enums import RestoreMode
from kvgate.protocol.step import NewRequest
from kvgate.scheduler.config import AdmissionPricing, Fairness
from kvgate.scheduler.events import AdmissionKind
from kvgate.scheduler.kv import Page
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import (
    EvictionReason,
    background_key,
    is_background,
    past_last_victim,
)
from kvgate.scheduler.preemption import evict_all, find_victims
from kvgate.scheduler.request import AdmissionKey, Fill, Request, RequestStatus
from kvgate.scheduler.state import SchedulerState


@dataclass(frozen=True, slots=True)
class StartPlan:
    """How a waiting request would start, priced before anything changes."""

    kind: str
    num_pages: int
    prefix: list[Page]
    fill_tokens: int
    cached_tokens: int
    blocks: int  # how much the free count must cover: the claim plus what it will be owed


def plan_start(state: SchedulerState, request: Request) -> StartPlan:
    pool = state.pool
    if request.restore_mode is RestoreMode.SNAPSHOT:
        pages = request.snapshot_pages
        return StartPlan(AdmissionKind.SNAPSHOT, pages, [], 0, 0, pool.claim_cost(pages, []))
    kind = AdmissionKind.RECOMPUTE if request.restore_mode is not None else AdmissionKind.FRESH
    fill_tokens = request.kv_tokens_needed
    prefix = pool.lookup_prefix(request.page_digests)
    cached_tokens = len(prefix) * pool.block_size
    if not state.config.incremental_allocation:
        pages = promised = state.capacity_pages(request)
    else:
        first = cached_tokens + state.first_chunk_tokens(fill_tokens - cached_tokens)
        pages = pool.pages_for(min(fill_tokens, first))
        if not state.preemption_enabled:
            promised = state.capacity_pages(request)
        elif state.config.admission_pricing is AdmissionPricing.FILL:
            promised = pool.pages_for(fill_tokens)
        else:
            promised = pages
    blocks = pool.claim_cost(pages - len(prefix), prefix)
    blocks += max(0, promised - pages) * state.num_planes
    return StartPlan(kind, pages, prefix, fill_tokens, cached_tokens, blocks)


def start(state: SchedulerState, request: Request, plan: StartPlan, builder: PlanBuilder) -> None:
    pool = state.pool
    if plan.kind == AdmissionKind.SNAPSHOT:
        pages = pool.allocate(request.request_id, plan.num_pages, [])
        if pages is None:
            raise AssertionError(f"priced snapshot restore of {request.request_id} did not fit")
        builder.swap_in_pages(request.request_id, pages)
        state.host_blocks_used -= request.snapshot_pages * state.num_planes
        builder.host_blocks_restored += request.snapshot_pages * state.num_planes
        request.snapshot_pages = 0
    else:
        pages = pool.allocate(request.request_id, plan.num_pages, plan.prefix)
        if pages is None:
            raise AssertionError(f"priced start of {request.request_id} did not fit")
        spec = request.spec
        builder.new_requests.append(
            NewRequest.model_construct(
                request_id=request.request_id,
                prompt_token_ids=list(spec.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                exit_depths=list(request.exit_depths),
                sampling=spec.sampling,
                loops=spec.loops,
                traceparent=spec.traceparent,
            )
        )
        builder.append_pages(request.request_id, [*plan.prefix, *pages])
        request.fill = Fill(
            length=plan.fill_tokens,
            start=plan.cached_tokens,
            num_loops=state.num_planes,
            wavefront=state.config.wavefront_prefill,
        )
        request.published_pages = len(plan.prefix)
        request.depth_done = 0
        request.on_executor = True
        if request.page_digests:  # the prefix cache was asked for its prompt
            builder.report.prefix_queried_tokens += plan.fill_tokens
            builder.report.prefix_hit_tokens += plan.cached_tokens
        if request.kv_tokens_lost:
            # A recompute restore here, or a request that lost its K/V with the executor it
            # left (a fresh start elsewhere from its progress).
            lost = min(request.kv_tokens_lost, plan.fill_tokens)
            request.recomputed_tokens += max(0, lost - plan.cached_tokens)
            request.kv_tokens_lost = 0
    if request.restore_mode is not None:
        request.restore_modes.append(request.restore_mode)
        request.restored_step = state.step
        request.restore_mode = None
    request.started_step = state.step
    request.evicted_by = None
    state.waiting.started(request)
    if request.first_admitted_step is None:
        request.first_admitted_step = state.step
    state.mark_running(request)
    builder.started.add(request.request_id)
    builder.report.admitted.append((request.request_id, plan.kind))


def _startable_now(state: SchedulerState, request: Request) -> bool:
    return request.evicted_step != state.step and request.inflight_step is None


def admit(state: SchedulerState, builder: PlanBuilder) -> None:
    config = state.config
    limit = config.max_admission_bypasses
    reserve = GrowthReserve(state)
    deferred: list[Request] = []
    background = background_key(config)
    for _ in range(config.admission_scan_limit):
        request = state.waiting.pop()
        if request is None:
            break
        if (
            background is not None
            and request.key >= background
            and _background_full(state, background, deferred)
        ):
            deferred.append(request)  # it and all behind it (background too) wait: no bypass
            break
        if _startable_now(state, request) and _try_start(state, request, reserve, builder):
            for blocked in deferred:
                blocked.bypasses += 1
                builder.report.bypassed.append(blocked.request_id)
            if any(blocked.bypasses >= limit for blocked in deferred):
                break
            continue
        deferred.append(request)
        if request.bypasses >= limit or _no_slot_for_anyone_behind(state, request, builder):
            break
    for request in deferred:
        state.waiting.push(request)
    # The scan pops in key order, and the background class is last: a more important request
    # still waiting was popped and deferred (or more important work runs, which caps too).
    builder.foreground_waiting = any(not is_background(config, r) for r in deferred)


def _background_full(
    state: SchedulerState, background: AdmissionKey, deferred: list[Request]
) -> bool:
    """Beside more important work (running, or waiting after this scan), the background class
    holds at most ``background_step_tokens`` running requests: as many as its passes per step
    can advance. More would only hold KV and slots that the other work takes back by
    preemption."""
    first = state.running.count_below(background)
    if first == 0 and all(is_background(state.config, r) for r in deferred):
        return False
    return len(state.running) - first >= state.config.background_step_tokens


def _try_start(
    state: SchedulerState, request: Request, reserve: GrowthReserve, builder: PlanBuilder
) -> bool:
    plan = plan_start(state, request)
    active = len(state.running)
    need_slot = active >= state.config.max_num_seqs
    if need_slot and _no_slot_for_anyone_behind(state, request, builder):
        return False
    headroom = (state.watermark_blocks if active else 0) + _evictor_reserve(state, request)
    short = plan.blocks + headroom + state.owed_blocks - state.pool.num_free_blocks
    bound = reserve.upper_bound(request)
    if bound is None or short + bound > 0:  # else even the largest reserve fits: nothing changes
        # With nothing it may evict, the request fits or waits: the reserve need only be summed
        # until it exceeds the slack.
        enough = None if _may_evict_for(state, request) else max(0, -short) + 1
        short += reserve.blocks_for(request, enough)
    if short > 0 or need_slot:
        victims = find_victims(
            state,
            request,
            max(0, short),
            need_slot,
            EvictionReason.ADMISSION,
            builder,
            keep=frozenset(plan.prefix),
        )
        if victims is None:
            return False
        # Victims free at least what was priced: their pages in the requester's prefix were not
        # counted (releasing those raises the claim's cost exactly as much as the free count).
        evict_all(state, victims, request, EvictionReason.ADMISSION, builder)
    start(state, request, plan, builder)
    return True


def _may_evict_for(state: SchedulerState, request: Request) -> bool:
    """Whether any running request is one admission may evict for ``request`` (the least
    important one runs last)."""
    if not state.preemption_enabled or not state.running:
        return False
    fair = state.config.fairness is not Fairness.OFF
    last = state.running.last()
    return not past_last_victim(request, last, EvictionReason.ADMISSION, fair=fair)


def _evictor_reserve(state: SchedulerState, request: Request) -> int:
    """A request evicted for another's growth restarts only with room left for that request's
    next page: starting in the blocks the evictor is about to need again would only end in
    another preemption."""
    evictor = state.requests.get(request.evicted_by) if request.evicted_by else None
    if evictor is None or evictor.status is not RequestStatus.RUNNING:
        return 0
    return state.num_planes


def _no_slot_for_anyone_behind(
    state: SchedulerState, request: Request, builder: PlanBuilder
) -> bool:
    """With every slot taken and nothing evictable for ``request``, no request behind it (none
    is more important) can get a slot either. Not so under fairness: a request behind it, of
    another tenant, may displace work ``request``'s tenant may not (``policy.may_evict``)."""
    if len(state.running) < state.config.max_num_seqs:
        return False
    if state.config.fairness is not Fairness.OFF:
        return False
    return find_victims(state, request, 0, True, EvictionReason.ADMISSION, builder) is None


# --- the growth reserve ------------------------------------------------------------------------
# The growth reserve: room admission keeps for the growth of running work ahead of a candidate.
#
# A request started into blocks that running requests ahead of it (in admission order) are about to
# grow into is evicted by that growth a few steps later: its start was wasted and a preemption paid
# for it. On the livelock suite this was most of kvgate's preemptions under both pricings
# (docs/scheduler.md). So admission prices a start with, on top of its own need, what those requests
# may claim within ``growth_reserve_steps`` steps:
#
#     reserve(c) = planes × Σ over running r with key(r) < key(c) of
#                  max(0, pages(min(capacity(r), frontier(r) + k)) − held(r) − owed(r))
#
# where ``frontier`` is the end of ``r``'s fill while it fills (its whole fill counts: under
# ``first_chunk`` pricing nothing else keeps room for it) and its decode cursor + 1 afterwards; a
# step decodes at most one token of a request, so ``k`` steps grow it by at most ``k`` tokens.
#
# Only work ahead of the candidate counts, never work it outranks. That work drains without the
# candidate (the running leader can always make room, and each request ahead leads in turn), and
# its reserve shrinks as it gets its pages and finishes, so the reserve delays a start but cannot
# block it for good.
#
# The admission scan prices candidates in increasing key order (it pops the waiting heap), and
# within one scan the requests already summed do not change: a start joins at the key of a
# candidate already priced, so above every request summed, and admission evicts only work behind
# its requester. So the sum is kept between candidates and each running request is looked at
# once per scan. When a candidate only needs to know whether the reserve reaches some amount
# (nothing could be evicted for it, so it either fits or waits), the walk stops there. And under
# ``fill`` pricing a running request's term is at most ``pages(k + 1)`` (it holds the pages of every
# position with K/V, and is owed the rest of its fill), so when even that bound fits there is
# nothing to walk: with a roomy cache the reserve costs a bisection.


def runner_growth_pages(state: SchedulerState, runner: Request, horizon: int) -> int:
    """Pages ``runner`` may still claim within ``horizon`` steps beyond what it holds or is owed."""
    pool = state.pool
    frontier = runner.fill.length if runner.fill is not None else runner.cursor_position + 1
    target = pool.pages_for(min(runner.capacity_tokens, frontier + horizon))
    return max(0, target - pool.num_pages(runner.request_id) - runner.owed_pages)


class GrowthReserve:
    """The reserve for each candidate of one admission scan, walking the running set once."""

    __slots__ = ("_asked", "_horizon", "_last", "_pages", "_state")

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        self._horizon = state.config.growth_reserve_steps if state.preemption_enabled else 0
        self._asked: AdmissionKey | None = None  # the last candidate's key
        # Key of the last running request summed: every one up to it is in ``_pages``.
        self._last: AdmissionKey | None = None
        self._pages = 0

    def upper_bound(self, request: Request) -> int | None:
        """At least ``blocks_for(request)``, in ``O(log n)``; ``None`` when no cheap bound is
        known (``first_chunk`` pricing: a running request's unclaimed fill is not bounded by
        the horizon)."""
        state = self._state
        if self._horizon == 0:
            return 0
        if state.config.admission_pricing is not AdmissionPricing.FILL:
            return None
        per_runner = state.pool.pages_for(self._horizon + 1) * state.num_planes
        return state.running.count_below(request.key) * per_runner

    def blocks_for(self, request: Request, enough: int | None = None) -> int:
        """Blocks the running requests ahead of ``request`` may grow into within the horizon;
        with ``enough``, any value of at least ``enough`` once the sum gets there."""
        if self._horizon == 0:
            return 0
        key = request.key
        if self._asked is not None and key < self._asked:
            self._last, self._pages = None, 0  # out of order (not the scan's way): start over
        self._asked = key
        planes = self._state.num_planes
        for runner in self._state.running.between(self._last, key):
            if enough is not None and self._pages * planes >= enough:
                break
            self._pages += runner_growth_pages(self._state, runner, self._horizon)
            self._last = runner.key
        return self._pages * planes
