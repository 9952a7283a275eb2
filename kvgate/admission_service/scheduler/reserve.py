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

Only work ahead of the candidate counts, never work it outranks. That work drains without the
candidate (the running leader can always make room, and each request ahead leads in turn), and
its reserve shrinks as it gets its pages and finishes, so the reserve delays a start but cannot
block it for good.

The admission scan prices candidates in increasing key order (it pops the waiting heap), and
within one scan the requests already summed do not change: a start joins at the key of a
candidate already priced, so above every request summed, and admission evicts only work behind
its requester. So the sum is kept between candidates and each running request is looked at
once per scan. When a candidate only needs to know whether the reserve reaches some amount
(nothing could be evicted for it, so it either fits or waits), the walk stops there. And under
``fill`` pricing a running request's term is at most ``pages(k + 1)`` (it holds the pages of every
position with K/V, and is owed the rest of its fill), so when even that bound fits there is
nothing to walk: with a roomy cache the reserve costs a bisection.
"""

from __future__ import annotations

from kvgate.admission_service.scheduler.config import AdmissionPricing
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

    __slots__ = ("_asked", "_horizon", "_last", "_pages", "_state")

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        self._horizon = state.config.growth_reserve_steps if state.preemption_enabled else 0
        self._asked: tuple[int, ...] | None = None  # the last candidate's key
        # Key of the last running request summed: every one up to it is in ``_pages``.
        self._last: tuple[int, ...] | None = None
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
