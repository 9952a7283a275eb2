"""The growth reserve: room admission keeps for the growth of running work ahead of a candidate.

A request started into blocks that running requests ahead of it (in admission order) are about to
grow into is evicted by that growth a few steps later: its start was wasted and a preemption paid
for it. On the livelock suite this was most of kvgate's preemptions under both pricings
(docs/scheduler.md). So admission prices a start with, on top of its own need, what those requests
may claim within ``growth_reserve_steps`` steps:

    reserve(c) = planes × Σ over running r with key(r) < key(c) of
                 max(0, pages(min(capacity(r), frontier(r) + k)) − held(r) − owed(r))

where ``frontier`` is the end of ``r``'s fill while it fills (its whole fill counts: under
``first_chunk`` pricing nothing else keeps room for it) and its decode cursor + 1 afterwards; a
step decodes at most one token of a request, so ``k`` steps grow it by at most ``k`` tokens.

Only work ahead of the candidate counts, never work it outranks, and work ahead always drains
(its growth may evict everything behind it), so the reserve delays a start but never blocks it.

The admission scan prices candidates in non-decreasing key order (it pops the waiting heap), and
within one scan the requests already walked do not change: starts join at the key of a candidate
already priced, and admission evicts only work behind its requester. So one walk of the running
set per scan serves every candidate, however many are priced.
"""

from __future__ import annotations

from kvgate.admission_service.scheduler.request import Request
from kvgate.admission_service.scheduler.state import SchedulerState


def runner_growth_pages(state: SchedulerState, runner: Request, horizon: int) -> int:
    """Pages ``runner`` may still claim within ``horizon`` steps beyond what it holds or is owed."""
    pool = state.pool
    frontier = runner.fill.length if runner.fill is not None else runner.cursor_position + 1
    target = pool.pages_for(min(runner.capacity_tokens, frontier + horizon))
    return max(0, target - pool.num_pages(runner.request_id) - runner.owed_pages)


class GrowthReserve:
    """The reserve for each candidate of one admission scan, walking the running set once."""

    __slots__ = ("_horizon", "_key", "_pages", "_state")

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        self._horizon = state.config.growth_reserve_steps if state.preemption_enabled else 0
        self._key: tuple[int, ...] | None = None  # every runner below this key is summed
        self._pages = 0

    def blocks_for(self, request: Request) -> int:
        """Blocks the running requests ahead of ``request`` may grow into within the horizon."""
        if self._horizon == 0:
            return 0
        key = request.key
        if self._key is not None and key < self._key:
            self._key, self._pages = None, 0  # out of order (not the scan's way): start over
        for runner in self._state.running.between(self._key, key):
            self._pages += runner_growth_pages(self._state, runner, self._horizon)
        self._key = key
        return self._pages * self._state.num_planes
