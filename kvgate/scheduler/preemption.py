"""Preemption: victim choice with a preflight, the restore-mode choice, and eviction itself.

A preemption is planned before anything is evicted: victims are taken in the one victim order
(least important first) until the blocks they would release cover the shortfall. If they cannot,
nothing is evicted — so a preemption always lets its requester proceed in the same step.
"""

from __future__ import annotations

from kvgate.protocol.enums import RestoreMode
from kvgate.scheduler.config import PreemptionMode
from kvgate.scheduler.events import Preemption
from kvgate.scheduler.fairness import FairWaitingQueue
from kvgate.scheduler.kv import Page
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import EvictionReason, may_evict, past_last_victim
from kvgate.scheduler.request import Request, RequestStatus
from kvgate.scheduler.state import SchedulerState


def find_victims(
    state: SchedulerState,
    requester: Request,
    blocks_short: int,
    need_slot: bool,
    reason: EvictionReason,
    builder: PlanBuilder,
    keep: frozenset[Page] = frozenset(),
) -> list[Request] | None:
    """The fewest least-important running requests whose release covers ``blocks_short`` blocks
    (and frees a slot when ``need_slot``), or ``None`` when no such set exists. Pages in ``keep``
    (the requester's own cached prefix) do not count as freed."""
    if not state.preemption_enabled:
        return None
    victims: list[Request] = []
    freed = 0
    leader = next(iter(state.running), None)
    waiting = state.waiting
    fair = isinstance(waiting, FairWaitingQueue) and reason is EvictionReason.ADMISSION
    reach = waiting.reach(requester) if isinstance(waiting, FairWaitingQueue) and fair else None
    for victim in reversed(state.running):
        short_of_blocks = freed < blocks_short
        short_of_slot = need_slot and not victims
        if not (short_of_blocks or short_of_slot):
            break
        if past_last_victim(requester, victim, reason, fair=fair):
            break
        if victim.request_id in builder.selected or victim.request_id in builder.started:
            continue
        if not may_evict(
            requester,
            victim,
            reason,
            step=state.step,
            min_residency_steps=state.config.min_residency_steps,
            requester_leads=requester is leader,
            reach=reach,
            standing=(
                waiting.standing(victim)
                if isinstance(waiting, FairWaitingQueue) and reach is not None
                else None
            ),
        ):
            continue
        reclaimable = state.pool.reclaimable_blocks(victim.request_id, keep)
        if reclaimable == 0 and not short_of_slot:
            continue  # it would free nothing the requester needs
        victims.append(victim)
        freed += reclaimable
    if freed >= blocks_short and (victims or not need_slot):
        return victims
    return None


def choose_restore_mode(
    state: SchedulerState, victim: Request, num_pages: int, builder: PlanBuilder
) -> RestoreMode:
    """``snapshot`` keeps the K/V in host memory; ``recompute`` refills it later.

    ``auto`` compares moving the blocks out and back with recomputing the positions (every loop
    pass of each), and snapshots only within the host budget."""
    mode = state.config.preemption
    blocks = num_pages * state.num_planes
    host_at_swap_out = state.host_blocks_used + builder.host_blocks_restored
    fits_host = host_at_swap_out + blocks <= state.cache.host_snapshot_blocks
    if mode is PreemptionMode.RECOMPUTE or not fits_host:
        return RestoreMode.RECOMPUTE
    if mode is PreemptionMode.SNAPSHOT:
        return RestoreMode.SNAPSHOT
    snapshot_cost = blocks * state.config.snapshot_block_cost_s
    recompute_cost = (
        victim.kv_frontier * state.num_planes * state.config.recompute_token_pass_cost_s
    )
    return RestoreMode.SNAPSHOT if snapshot_cost < recompute_cost else RestoreMode.RECOMPUTE


def evict(
    state: SchedulerState,
    victim: Request,
    requester: Request,
    reason: EvictionReason,
    builder: PlanBuilder,
    mode: RestoreMode | None = None,
) -> None:
    """Move ``victim`` from running back to the waiting order (original arrival stamp)."""
    num_pages = state.pool.num_pages(victim.request_id)
    if mode is None:
        mode = choose_restore_mode(state, victim, num_pages, builder)
    builder.report.preemptions.append(
        Preemption(
            victim_id=victim.request_id,
            requester_id=requester.request_id,
            reason=reason,
            mode=mode,
            victim_restored_step=victim.restored_step,
            victim_priority_class=victim.priority_class,
            requester_priority_class=requester.priority_class,
        )
    )
    state.release_blocks(victim)
    state.running.remove(victim)
    if mode is RestoreMode.SNAPSHOT:
        # The executor freezes everything (tables, cursor, wavefront hidden states) in host
        # memory; the scheduler keeps its own progress as it is.
        builder.swap_out.append(victim.request_id)
        victim.snapshot_pages = num_pages
        state.host_blocks_used += num_pages * state.num_planes
    else:
        builder.free.append(victim.request_id)
        victim.on_executor = False
        victim.kv_tokens_lost = victim.kv_frontier
        victim.fill = None
        victim.depth_done = 0  # an unfinished token restarts from its first pass
    victim.restore_mode = mode
    victim.status = RequestStatus.WAITING
    victim.evicted_step = state.step
    victim.evicted_by = requester.request_id if reason is EvictionReason.GROWTH else None
    victim.num_preemptions += 1
    state.waiting.push(victim)


def evict_all(
    state: SchedulerState,
    victims: list[Request],
    requester: Request,
    reason: EvictionReason,
    builder: PlanBuilder,
) -> None:
    for victim in victims:
        evict(state, victim, requester, reason, builder)
