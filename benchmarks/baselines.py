"""Other admission rules, replayed on kvgate's state, executor and invariant checks.

Loadable with ``kvgate sim WORKLOAD.json --admission benchmarks.baselines:NAME``:

- ``SeedPreFix``: the rule of the scheduler the livelock was found in. Restores return before
  the bypass accounting (a successful restore never counts as overtaking anyone) and a blocked
  restore is deferred without checking its own bypass limit. Restores take their snapshot's pages
  on a raw fit (no headroom). Growth preempts the least important other running request (by
  priority, then footprint) with no check that this frees enough.
- ``SeedPostFix``: the seed PR's fix: restores go through the common accounting, blocked
  restores check the limit, and a fresh admission that does not fit evicts strictly less
  important work one victim at a time, re-planning after each, with no preflight.
- ``VllmStyle``: recompute-only preemption, strict head-of-line admission (no bypassing at all),
  running requests first and no admission in a step that preempted; growth preempts the lowest
  priority running request, one at a time.

These re-implement the rules for comparison; they are not used by kvgate itself.
"""

from __future__ import annotations

from kvgate.admission_service.scheduler import batch
from kvgate.admission_service.scheduler.admission import plan_start, start
from kvgate.admission_service.scheduler.plan import PlanBuilder
from kvgate.admission_service.scheduler.policy import EvictionReason
from kvgate.admission_service.scheduler.preemption import evict
from kvgate.admission_service.scheduler.request import Request
from kvgate.admission_service.scheduler.state import SchedulerState
from kvgate.protocol.enums import RestoreMode


def _footprint_victim(
    state: SchedulerState, requester: Request, builder: PlanBuilder, *, lower_priority_only: bool
) -> Request | None:
    """The seed's ranking: largest (priority value, pages held) among other running requests."""
    best: Request | None = None
    best_key: tuple[int, int] | None = None
    for victim in state.running:
        if victim is requester or victim.request_id in builder.selected:
            continue
        if victim.request_id in builder.started:
            continue
        if lower_priority_only and victim.spec.priority <= requester.spec.priority:
            continue
        key = (victim.spec.priority, state.pool.num_pages(victim.request_id))
        if best_key is None or key > best_key:
            best, best_key = victim, key
    return best


def _fits(state: SchedulerState, request: Request, *, headroom: bool) -> bool:
    plan = plan_start(state, request)
    extra = state.watermark_blocks if headroom and len(state.running) else 0
    return plan.blocks + extra + state.owed_blocks <= state.pool.num_free_blocks


class _SeedStrategy:
    name = "seed"
    restores_count_as_admissions = False
    blocked_restores_check_limit = False
    fresh_admission_preempts = False

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        self.admit(state, builder)
        batch.select_rows(state, builder, self)

    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool:
        victim = _footprint_victim(state, requester, builder, lower_priority_only=False)
        if victim is None:
            return False
        evict(state, victim, requester, EvictionReason.GROWTH, builder)
        return True

    def _ensure_slot(self, state: SchedulerState, request: Request, builder: PlanBuilder) -> bool:
        if len(state.running) < state.config.max_num_seqs:
            return True
        victim = _footprint_victim(state, request, builder, lower_priority_only=True)
        if victim is None:
            return False
        evict(state, victim, request, EvictionReason.ADMISSION, builder)
        return True

    def admit(self, state: SchedulerState, builder: PlanBuilder) -> None:
        limit = state.config.max_admission_bypasses
        deferred: list[Request] = []
        for _ in range(state.config.admission_scan_limit):
            request = state.waiting.pop()
            if request is None:
                break
            blocked_now = request.evicted_step == state.step or request.inflight_step is not None
            if not blocked_now and not self._ensure_slot(state, request, builder):
                deferred.append(request)
                break
            if request.restore_mode is RestoreMode.SNAPSHOT:
                if not blocked_now and _fits(state, request, headroom=False):
                    start(state, request, plan_start(state, request), builder)
                    if not self.restores_count_as_admissions:
                        continue
                else:
                    deferred.append(request)
                    if self.blocked_restores_check_limit and request.bypasses >= limit:
                        break
                    continue
            else:
                admitted = not blocked_now and _fits(state, request, headroom=True)
                while not admitted and not blocked_now and self.fresh_admission_preempts:
                    victim = _footprint_victim(state, request, builder, lower_priority_only=True)
                    if victim is None:
                        break
                    evict(state, victim, request, EvictionReason.ADMISSION, builder)
                    admitted = _fits(state, request, headroom=True)
                if not admitted:
                    deferred.append(request)
                    if request.bypasses >= limit:
                        break
                    continue
                start(state, request, plan_start(state, request), builder)
            for blocked in deferred:
                blocked.bypasses += 1
                builder.report.bypassed.append(blocked.request_id)
            if any(blocked.bypasses >= limit for blocked in deferred):
                break
        for request in deferred:
            state.waiting.push(request)


class SeedPreFix(_SeedStrategy):
    name = "seed-pre-fix"


class SeedPostFix(_SeedStrategy):
    name = "seed-post-fix"
    restores_count_as_admissions = True
    blocked_restores_check_limit = True
    fresh_admission_preempts = True


class VllmStyle:
    name = "vllm-style"

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
            if blocked or not _fits(state, request, headroom=True):
                state.waiting.push(request)  # strict head-of-line: nobody passes it
                return
            start(state, request, plan_start(state, request), builder)


STRATEGIES = {s.name: s for s in (SeedPreFix, SeedPostFix, VllmStyle)}
