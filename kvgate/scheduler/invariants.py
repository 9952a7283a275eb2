"""The scheduler invariants as code; tests call ``Scheduler.check_invariants()`` every step.

1. Conservation: free + used = total; each block's references match its holders; snapshots fit
   the host budget and are accounted to exactly the requests that hold them.
2. Bounded bypass: no request was bypassed more than ``max_admission_bypasses`` times.
3. No ineffective preemption: every preemption's requester was started or got a row in the same
   step.
4. Residency: a request restored less than ``min_residency_steps`` ago was only preempted by a
   requester of a strictly more important class.
5. Feasibility: every queued request fits an empty cache.
6. Progress: the no-progress counter is below ``stall_steps`` (``schedule`` raises at the bound).
7. Fair order (under ``fairness``): the waiting heap is the fair order of the moment — every
   lane's head is its first request and has exactly one live heap entry, stamped with its
   tenant's current share; no other request not yet admitted is in the heap; every backlogged
   tenant's counter is at least its class's floor less the credit of its lift (the lift);
   every output token served to a running request is charged to its tenant. Without fairness
   there is nothing to check.

``violations`` reports them by name, so a run of another rule (benchmarks/baselines.py) can be
judged by the invariants that rule promises and have kvgate's others reported beside it.
"""

from __future__ import annotations

from enum import StrEnum

from kvgate.scheduler.errors import InvariantViolation
from kvgate.scheduler.events import StepReport
from kvgate.scheduler.fairness import FairWaitingQueue
from kvgate.scheduler.request import RequestStatus
from kvgate.scheduler.state import SchedulerState


class Invariant(StrEnum):
    CONSERVATION = "conservation"
    BOUNDED_BYPASS = "bounded_bypass"
    EFFECTIVE_PREEMPTION = "effective_preemption"
    RESIDENCY = "residency"
    FEASIBILITY = "feasibility"
    PROGRESS = "progress"
    FAIR_ORDER = "fair_order"


ALL_INVARIANTS = frozenset(Invariant)


def violations(state: SchedulerState, report: StepReport) -> dict[Invariant, list[str]]:
    """The broken invariants after the step ``report`` describes, each with its problems."""
    found = {
        Invariant.CONSERVATION: _conservation(state),
        Invariant.BOUNDED_BYPASS: _bounded_bypass(state),
        Invariant.EFFECTIVE_PREEMPTION: _effective_preemptions(state, report),
        Invariant.RESIDENCY: _residency(state, report),
        Invariant.FEASIBILITY: _feasibility(state),
        Invariant.PROGRESS: _progress(state),
        Invariant.FAIR_ORDER: _fair_order(state),
    }
    return {invariant: problems for invariant, problems in found.items() if problems}


def check(state: SchedulerState, report: StepReport) -> None:
    problems = [p for found in violations(state, report).values() for p in found]
    if problems:
        raise InvariantViolation(problems)


def _progress(state: SchedulerState) -> list[str]:
    if state.steps_without_progress >= state.config.stall_steps:
        return [f"no progress for {state.steps_without_progress} steps"]
    return []


def _conservation(state: SchedulerState) -> list[str]:
    pool = state.pool
    problems = pool.check()
    snapshot_blocks = 0
    for request in state.requests.values():
        has_table = pool.has_table(request.request_id)
        if (request.status is RequestStatus.RUNNING) != has_table:
            problems.append(f"{request.request_id} is {request.status} but has_table={has_table}")
        snapshot_blocks += request.snapshot_pages * state.num_planes
    if snapshot_blocks != state.host_blocks_used:
        problems.append(
            f"host snapshot blocks {state.host_blocks_used} != held by requests {snapshot_blocks}"
        )
    if state.host_blocks_used > state.cache.host_snapshot_blocks:
        problems.append(
            f"snapshots use {state.host_blocks_used} host blocks, budget "
            f"{state.cache.host_snapshot_blocks}"
        )
    if len(state.running) > state.config.max_num_seqs:
        problems.append(f"{len(state.running)} running > max_num_seqs")
    owed = 0
    for request in state.running:
        expected = max(0, state.owed_target_pages(request) - pool.num_pages(request.request_id))
        if request.owed_pages != expected:
            problems.append(f"{request.request_id} owed {request.owed_pages} pages, not {expected}")
        owed += request.owed_pages * state.num_planes
    if owed != state.owed_blocks:
        problems.append(f"owed blocks {state.owed_blocks} != sum over running requests {owed}")
    if not state.preemption_enabled and owed > pool.num_free_blocks:
        problems.append(f"owed blocks {owed} > free blocks {pool.num_free_blocks}: growth may fail")
    return problems


def _bounded_bypass(state: SchedulerState) -> list[str]:
    limit = state.config.max_admission_bypasses
    return [
        f"{r.request_id} bypassed {r.bypasses} times (limit {limit})"
        for r in state.requests.values()
        if r.bypasses > limit
    ]


def _effective_preemptions(state: SchedulerState, report: StepReport) -> list[str]:
    return [
        f"step {report.step_id}: preempted {p.victim_id} for {p.requester_id}, which did not "
        "proceed in that step"
        for p in report.preemptions
        if p.requester_id not in report.progressed_request_ids
    ]


def _residency(state: SchedulerState, report: StepReport) -> list[str]:
    window = state.config.min_residency_steps
    return [
        f"step {report.step_id}: {p.victim_id} restored at step {p.victim_restored_step} was "
        f"preempted by {p.requester_id} of class {p.requester_priority_class} "
        f"(victim class {p.victim_priority_class}) inside the residency window"
        for p in report.preemptions
        if p.victim_restored_step is not None
        and report.step_id - p.victim_restored_step < window
        and not p.requester_priority_class < p.victim_priority_class
    ]


def _fair_order(state: SchedulerState) -> list[str]:
    waiting = state.waiting
    if not isinstance(waiting, FairWaitingQueue):
        return []
    ordering, clock = waiting.ordering, waiting.clock
    problems: list[str] = []
    entries: dict[str, list[tuple[float, ...]]] = {}
    for key, request in waiting.live_entries():
        entries.setdefault(request.request_id, []).append(key)
    lanes, heads = waiting.lanes(), waiting.heads()
    if set(lanes) != set(heads):
        problems.append(f"lanes {sorted(lanes)} but heads {sorted(heads)}")
    for lane, members in lanes.items():
        head = heads.get(lane)
        if head is not members[0]:
            problems.append(f"lane {lane}: head {head and head.request_id} is not its first")
            continue
        expected = ordering.key(head, clock.share(lane))
        if entries.get(head.request_id) != [expected]:
            problems.append(
                f"lane {lane}: head {head.request_id} has heap entries "
                f"{entries.get(head.request_id)}, expected [{expected}] at share "
                f"{clock.share(lane)}"
            )
        for request in members[1:]:
            if request.request_id in entries:
                problems.append(f"{request.request_id} is in the heap behind its lane's head")
        if clock.share(lane) < clock.floor(lane[0]) - clock.credit(lane) - 1e-9:
            problems.append(
                f"tenant {lane[1]} backlogged in class {lane[0]} at {clock.share(lane)}, below "
                f"the floor {clock.floor(lane[0])} less its credit {clock.credit(lane)}"
            )
    for request in state.running:
        if request.charged_outputs != len(request.output_token_ids):
            problems.append(
                f"{request.request_id} was served {len(request.output_token_ids)} outputs, "
                f"{request.charged_outputs} charged"
            )
    return problems


def _feasibility(state: SchedulerState) -> list[str]:
    pool = state.pool
    return [
        f"{r.request_id} cannot fit an empty cache"
        for r in state.requests.values()
        if pool.pages_for(r.capacity_tokens) * state.num_planes > state.cache.num_blocks
    ]


def dump(state: SchedulerState, limit: int = 32) -> str:
    """A readable picture of the scheduler for ``SchedulerStalled``."""
    pool = state.pool
    lines = [
        f"step {state.step}: blocks free {pool.num_free_blocks}/{pool.num_blocks}, host "
        f"{state.host_blocks_used}/{state.cache.host_snapshot_blocks}, "
        f"{len(state.running)} running, {len(state.waiting)} waiting",
        "running (admission order):",
    ]
    for r in list(state.running)[:limit]:
        fill = f"fill {r.fill.full_depth_frontier()}/{r.fill.length}" if r.fill else "decode"
        lines.append(
            f"  {r.request_id} key={r.key} pages={pool.num_pages(r.request_id)} {fill} "
            f"outputs={len(r.output_token_ids)} depth_done={r.depth_done} "
            f"preemptions={r.num_preemptions}"
        )
    lines.append("waiting (admission order):")
    for r in state.waiting.ordered(limit):
        lines.append(
            f"  {r.request_id} key={r.key} restore={r.restore_mode} "
            f"snapshot_pages={r.snapshot_pages} bypasses={r.bypasses} "
            f"outputs={len(r.output_token_ids)}"
        )
    return "\n".join(lines)
