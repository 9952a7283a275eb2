"""Other admission rules, run on kvgate's state, simulated executor and checks for comparison.

Loadable with ``kvgate sim WORKLOAD.json --admission benchmarks.baselines:NAME``. kvgate itself
never uses them.

``SeedPreFix`` and ``SeedPostFix`` are vllm-rlt's scheduler rules (its ``_admit``, preemption
manager and KV allocator) before and after the seed PR (#165), as its code has them:

1. Waiting order: a queue stable-sorted by priority value at every admission scan. A preempted
   request joins the tail (behind waiting requests of its priority); requests deferred by a scan
   go back to the front, in their order.
2. The scan looks at ``min(len(waiting), admission_scan_limit)`` heads. With every slot taken the
   head first evicts a running request of strictly lower priority for a slot (``priority``
   policy only), or the scan stops.
3. A preempted request restores from its snapshot on a raw fit of the snapshot's pages: nothing
   else is kept free for it or for anyone. It may restore in the step it was evicted in.
4. A fresh request is priced at its whole prompt, plus what every running prefill has still to
   claim (vllm-rlt's reserved growth, kvgate's ``fill`` pricing), plus the watermark when work is
   active; it claims its first chunk. If it does not fit, it evicts running work of strictly lower
   priority one victim at a time and is priced again after each, until it fits or no such victim
   is left. The pre-fix code of the seed's upstream already had this loop; the fix only moved it.
5. A fresh admission adds one to the bypass counter of every request deferred earlier in the scan
   and stops the scan once one of them reaches ``max_admission_bypasses``; a fresh request that
   cannot start stops the scan when its own counter is at the limit.
6. A victim is the running request with the largest (priority value, blocks for its position + 1),
   first in arrival order among equals: never the requester, never one with a row in this step.
   Growth takes any such request, admission only one of strictly lower priority. A request
   started in this step may be the victim (its start is withdrawn: kvgate's executor swaps out
   before it admits, so the two cannot be sent in one step). A request that held no computed
   state comes back the way a snapshot restore does, on a raw fit of the pages it held.
7. Every victim is snapshotted, never recomputed: vllm-rlt's host memory has no bound, so these
   rules run with a host budget that holds every request at once (``adapt_workload``).

``SeedPreFix``: a successful restore returns before the bypass accounting (it bypasses nobody)
and a blocked restore is deferred without checking its own counter. ``SeedPostFix``: restores go
through the common accounting and a blocked restore checks its counter, as the PR has it.

Variants that keep an option vllm-rlt does not have, named for it:
``SeedPreFixNoAdmissionPreemption`` is the pre-fix rule without the loop of point 4 (vllm-rlt
d40afb7d, older than the seed's upstream); ``SeedPreFixFirstChunk`` and ``SeedPostFixFirstChunk``
price a fresh start at its first chunk alone (kvgate's ``admission_pricing: first_chunk``).

Where these rules cannot follow vllm-rlt's engine:
- A vllm-rlt step is one *stage batch*: a decode token passes a prelude batch, k recurrent
  batches and a coda batch, and its refill policy admits only in a call where no boundary or
  due decode batch comes first. A kvgate step holds rows of every stage, and admission runs
  every step. Step counts compare within kvgate's step model, not with vllm-rlt's.
- vllm-rlt has no ``mixed`` mode, and its wavefront prefill refuses preemption: on those cases
  the seed's rules run on kvgate's modes, which no public vllm-rlt code can run.
- With async scheduling vllm-rlt never evicts a request whose sampled token is still on its way;
  kvgate's executor finishes rows in flight before a swap-out, so no such exclusion is applied,
  and a request cannot restart while results of its last rows are in flight.

They are judged by the invariants they promise (``promises``): block conservation, feasibility
and their own bypass counter against ``max_admission_bypasses``. kvgate's other invariants
(effective preemption, residency, progress, the bypass audit in kvgate's order) are reported
apart and do not fail a run; the step cap, not kvgate's stall detector, ends a run that does
not drain.

``VllmStyle``: recompute-only preemption, strict head-of-line admission (no bypassing at all),
running requests first and no admission in a step that preempted; growth preempts the least
important running request, one at a time, never a more important one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from enum import Enum

from kvgate.protocol.enums import RestoreMode
from kvgate.scheduler import batch
from kvgate.scheduler.admission import StartPlan, plan_start, start
from kvgate.scheduler.config import AdmissionPricing, Policy
from kvgate.scheduler.events import AdmissionKind, Preemption
from kvgate.scheduler.invariants import Invariant
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import EvictionReason
from kvgate.scheduler.preemption import evict
from kvgate.scheduler.request import Request, RequestStatus
from kvgate.scheduler.state import SchedulerState, WaitingQueue
from kvgate.sim.workload import Workload

# What the replayed rules promise themselves; kvgate's other invariants are reported apart.
OWN_RULES = frozenset({Invariant.CONSERVATION, Invariant.BOUNDED_BYPASS, Invariant.FEASIBILITY})


class HostBudgetTooSmall(RuntimeError):
    """The seed's rules snapshot every victim; vllm-rlt's host memory has no bound."""


def judged_by_the_step_cap(workload: Workload) -> Workload:
    """kvgate's stall detector off: a replayed rule runs until it drains or hits ``max_steps``."""
    scheduler = workload.scheduler.model_copy(update={"stall_steps": workload.max_steps + 1})
    return workload.model_copy(update={"scheduler": scheduler})


def unbounded_host(workload: Workload) -> Workload:
    """A host snapshot budget that holds every request's whole capacity at once."""
    model = workload.model
    bs = workload.cache.block_size
    blocks = sum(
        -(-(len(r.prompt_tokens(model)) + r.max_tokens - 1) // bs) * model.loops
        for r in workload.requests
    )
    host = max(blocks, workload.cache.host_snapshot_blocks)
    cache = workload.cache.model_copy(update={"host_snapshot_blocks": host})
    return workload.model_copy(update={"cache": cache})


class _Resume(Enum):
    NOT_PREEMPTED = "not_preempted"  # a fresh request: no snapshot to restore
    RESTORED = "restored"
    BLOCKED = "blocked"  # a snapshot whose pages do not fit now


def _drain(queue: WaitingQueue) -> dict[str, Request]:
    drained: dict[str, Request] = {}
    while (request := queue.pop()) is not None:
        drained[request.request_id] = request
    return drained


def _victim(
    state: SchedulerState, requester: Request, builder: PlanBuilder, *, lower_priority_only: bool
) -> Request | None:
    """vllm-rlt's choice: the largest (priority value, blocks for position + 1) among running
    requests other than the requester and this step's rows; the first in arrival order wins a
    tie."""
    best: Request | None = None
    best_key: tuple[int, int] | None = None
    for candidate in state.requests.values():
        if candidate.status is not RequestStatus.RUNNING or candidate is requester:
            continue
        if candidate.request_id in builder.selected:
            continue
        if lower_priority_only and candidate.spec.priority <= requester.spec.priority:
            continue
        position = candidate.prompt_len + len(candidate.output_token_ids) - 1
        key = (candidate.spec.priority, state.pool.pages_for(position + 1))
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    return best


def _reserved_growth(state: SchedulerState) -> int:
    """Blocks the running prefills have still to claim for their whole fill."""
    pool = state.pool
    pages = sum(
        max(0, pool.pages_for(r.fill.length) - pool.num_pages(r.request_id))
        for r in state.running
        if r.fill is not None
    )
    return pages * state.num_planes


class _SeedRules:
    name = "seed"
    promises = OWN_RULES
    restores_count_as_admissions = False
    blocked_restores_check_limit = False
    fresh_admission_preempts = True
    pricing = AdmissionPricing.FILL

    def __init__(self) -> None:
        self._order: deque[str] = deque()  # the waiting queue, in vllm-rlt's order
        # Requests whose start was withdrawn by an eviction in the same step, with the pages they
        # held: vllm-rlt would have snapshotted them, so they restore on a raw fit of those.
        self._withdrawn: dict[str, int] = {}

    def adapt_workload(self, workload: Workload) -> Workload:
        return judged_by_the_step_cap(unbounded_host(workload))

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        self.admit(state, builder)
        batch.select_rows(state, builder, self)

    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool:
        """One victim per try, whether or not it frees enough (the requester retries once)."""
        victim = _victim(state, requester, builder, lower_priority_only=False)
        if victim is None:
            return False
        self._evict(state, victim, requester, EvictionReason.GROWTH, builder)
        return True

    # --- the admission scan --------------------------------------------------------------------
    def admit(self, state: SchedulerState, builder: PlanBuilder) -> None:
        waiting = _drain(state.waiting)
        order = self._sync_order(state, waiting)
        limit = state.config.max_admission_bypasses
        deferred: list[Request] = []
        for _ in range(min(len(order), state.config.admission_scan_limit)):
            if not order:
                break
            head = state.requests[order[0]]
            if not self._ensure_slot(state, head, builder):
                break
            order.popleft()
            outcome = self._try_resume(state, head, builder)
            if outcome is _Resume.BLOCKED:
                deferred.append(head)
                if self.blocked_restores_check_limit and head.bypasses >= limit:
                    break
                continue
            if outcome is _Resume.RESTORED and not self.restores_count_as_admissions:
                continue
            if outcome is _Resume.NOT_PREEMPTED and not self._admit_fresh(state, head, builder):
                deferred.append(head)
                if head.bypasses >= limit:
                    break
                continue
            for blocked in deferred:
                blocked.bypasses += 1
                builder.report.bypassed.append(blocked.request_id)
            if any(blocked.bypasses >= limit for blocked in deferred):
                break
        order.extendleft(reversed([r.request_id for r in deferred]))
        self._refill_waiting(state)

    def _sync_order(self, state: SchedulerState, waiting: dict[str, Request]) -> deque[str]:
        """Drop what left the queue, append arrivals, and stable-sort by priority."""
        order = [rid for rid in self._order if rid in waiting]
        listed = set(order)
        arrivals = sorted(
            (r for rid, r in waiting.items() if rid not in listed), key=lambda r: r.arrival_seq
        )
        order.extend(r.request_id for r in arrivals)
        if state.config.policy is Policy.PRIORITY:
            order.sort(key=lambda rid: waiting[rid].spec.priority)
        self._order = deque(order)
        self._withdrawn = {rid: n for rid, n in self._withdrawn.items() if rid in waiting}
        return self._order

    def _refill_waiting(self, state: SchedulerState) -> None:
        """Give kvgate's waiting queue (reports, audits) exactly the requests still waiting."""
        _drain(state.waiting)  # victims evicted during the scan were pushed there
        for rid in self._order:
            state.waiting.push(state.requests[rid])

    def _ensure_slot(self, state: SchedulerState, head: Request, builder: PlanBuilder) -> bool:
        if len(state.running) < state.config.max_num_seqs:
            return True
        if state.config.policy is not Policy.PRIORITY:
            return False
        victim = _victim(state, head, builder, lower_priority_only=True)
        if victim is None:
            return False
        self._evict(state, victim, head, EvictionReason.ADMISSION, builder)
        return True

    def _try_resume(self, state: SchedulerState, request: Request, builder: PlanBuilder) -> _Resume:
        rid = request.request_id
        if request.restore_mode is RestoreMode.SNAPSHOT:
            pages: int | None = request.snapshot_pages
        else:
            pages = self._withdrawn.get(rid)
        if pages is None:
            return _Resume.NOT_PREEMPTED
        if request.inflight_step is not None or (
            pages * state.num_planes > state.pool.num_free_blocks
        ):
            return _Resume.BLOCKED
        plan = plan_start(state, request)
        if request.restore_mode is not RestoreMode.SNAPSHOT:
            del self._withdrawn[rid]
            plan = replace(plan, num_pages=pages, prefix=[], cached_tokens=0)
        self._start(state, request, plan, builder)
        return _Resume.RESTORED

    def _admit_fresh(self, state: SchedulerState, request: Request, builder: PlanBuilder) -> bool:
        while True:
            plan = plan_start(state, request)
            if self._price(state, plan) <= state.pool.num_free_blocks:
                self._start(state, request, plan, builder)
                return True
            if not self.fresh_admission_preempts:
                return False
            victim = _victim(state, request, builder, lower_priority_only=True)
            if victim is None:
                return False
            self._evict(state, victim, request, EvictionReason.ADMISSION, builder)

    def _price(self, state: SchedulerState, plan: StartPlan) -> int:
        pool = state.pool
        need = pool.claim_cost(plan.num_pages - len(plan.prefix), plan.prefix)
        if state.running:
            need += state.watermark_blocks
        if self.pricing is AdmissionPricing.FILL:
            rest = max(0, pool.pages_for(plan.fill_tokens) - plan.num_pages)
            need += rest * state.num_planes + _reserved_growth(state)
        return need

    def _start(
        self, state: SchedulerState, request: Request, plan: StartPlan, builder: PlanBuilder
    ) -> None:
        state.waiting.discard(request)  # a victim of this scan was pushed there
        start(state, request, plan, builder)

    # --- eviction -------------------------------------------------------------------------------
    def _evict(
        self,
        state: SchedulerState,
        victim: Request,
        requester: Request,
        reason: EvictionReason,
        builder: PlanBuilder,
    ) -> None:
        if victim.request_id in builder.started:
            self._withdraw_start(state, victim, requester, reason, builder)
        else:
            blocks = state.pool.num_pages(victim.request_id) * state.num_planes
            host = state.host_blocks_used + builder.host_blocks_restored + blocks
            if host > state.cache.host_snapshot_blocks:
                raise HostBudgetTooSmall(
                    f"{self.name} snapshots every victim (vllm-rlt's host memory has no bound); "
                    f"host_snapshot_blocks={state.cache.host_snapshot_blocks} cannot hold "
                    f"{host}: run it on benchmarks.baselines.unbounded_host(workload)"
                )
            evict(state, victim, requester, reason, builder, RestoreMode.SNAPSHOT)
        self._order.append(victim.request_id)

    def _withdraw_start(
        self,
        state: SchedulerState,
        victim: Request,
        requester: Request,
        reason: EvictionReason,
        builder: PlanBuilder,
    ) -> None:
        """Evict a request started in this step: take its start back out of the plan."""
        rid = victim.request_id
        kind = next(k for r, k in reversed(builder.report.admitted) if r == rid)
        pages = state.pool.num_pages(rid)
        builder.withdraw(rid)
        builder.started.discard(rid)
        state.release_blocks(victim)
        state.running.remove(victim)
        if kind == AdmissionKind.SNAPSHOT:  # its snapshot stays where it was
            blocks = pages * state.num_planes
            state.host_blocks_used += blocks
            builder.host_blocks_restored -= blocks
            victim.snapshot_pages = pages
            victim.restore_mode = RestoreMode.SNAPSHOT  # the restore still counts, as in vllm-rlt
        else:
            if kind != AdmissionKind.FRESH:
                raise AssertionError(f"the seed's rules never recompute ({rid} started as {kind})")
            victim.fill = None
            victim.on_executor = False
            victim.published_pages = 0
            victim.depth_done = 0
            self._withdrawn[rid] = pages
        builder.report.preemptions.append(
            Preemption(
                victim_id=rid,
                requester_id=requester.request_id,
                reason=reason,
                mode=RestoreMode.SNAPSHOT,
                victim_restored_step=victim.restored_step,
                victim_priority_class=victim.priority_class,
                requester_priority_class=requester.priority_class,
            )
        )
        victim.status = RequestStatus.WAITING
        victim.evicted_step = state.step
        victim.evicted_by = requester.request_id if reason is EvictionReason.GROWTH else None
        victim.num_preemptions += 1
        state.waiting.push(victim)


class SeedPreFix(_SeedRules):
    name = "seed-pre-fix"


class SeedPostFix(_SeedRules):
    name = "seed-post-fix"
    restores_count_as_admissions = True
    blocked_restores_check_limit = True


class SeedPreFixNoAdmissionPreemption(SeedPreFix):
    name = "seed-pre-fix-no-admission-preemption"
    fresh_admission_preempts = False


class SeedPreFixFirstChunk(SeedPreFix):
    name = "seed-pre-fix-first-chunk"
    pricing = AdmissionPricing.FIRST_CHUNK


class SeedPostFixFirstChunk(SeedPostFix):
    name = "seed-post-fix-first-chunk"
    pricing = AdmissionPricing.FIRST_CHUNK


def _fits(state: SchedulerState, request: Request) -> bool:
    plan = plan_start(state, request)
    extra = state.watermark_blocks if len(state.running) else 0
    return plan.blocks + extra + state.owed_blocks <= state.pool.num_free_blocks


class VllmStyle:
    name = "vllm-style"
    promises = OWN_RULES

    def adapt_workload(self, workload: Workload) -> Workload:
        return judged_by_the_step_cap(workload)

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        batch.select_rows(state, builder, self)
        if not builder.report.preemptions:
            self.admit(state, builder)

    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool:
        candidates = [
            r
            for r in state.running
            if r is not requester
            and r.request_id not in builder.selected
            and r.request_id not in builder.started
        ]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: r.key)
        if victim.key < requester.key:
            return False  # the requester is the lowest priority: it waits
        evict(state, victim, requester, EvictionReason.GROWTH, builder, RestoreMode.RECOMPUTE)
        return True

    def admit(self, state: SchedulerState, builder: PlanBuilder) -> None:
        while len(state.running) < state.config.max_num_seqs:
            request = state.waiting.pop()
            if request is None:
                return
            blocked = request.evicted_step == state.step or request.inflight_step is not None
            if blocked or not _fits(state, request):
                state.waiting.push(request)  # strict head-of-line: nobody passes it
                return
            start(state, request, plan_start(state, request), builder)


SEED_RULES = (SeedPreFix, SeedPostFix)
VARIANTS = (SeedPreFixNoAdmissionPreemption, SeedPreFixFirstChunk, SeedPostFixFirstChunk)
STRATEGIES = {s.name: s for s in (*SEED_RULES, *VARIANTS, VllmStyle)}
