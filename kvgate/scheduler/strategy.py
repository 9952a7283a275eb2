"""The seam where a step's admission and room-making decisions are made.

Production uses ``KvgateStrategy`` (the one admission loop, preflighted preemption). The seam
exists so benchmarks can replay other rules — the seed's pre-fix and post-fix admission, a
vLLM-style rule — against the same state, executor and invariant checks, and show the difference.

Another rule is judged by what it promises itself: a strategy may name those invariants in a
``promises`` attribute (``promises(strategy)`` reads it); kvgate's own strategy promises them all.
The simulator judges a run by the promised ones and reports kvgate's others beside them.
"""

from __future__ import annotations

from typing import Protocol

from kvgate.scheduler import admission, batch
from kvgate.scheduler.invariants import ALL_INVARIANTS, Invariant
from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.policy import EvictionReason
from kvgate.scheduler.preemption import evict_all, find_victims
from kvgate.scheduler.request import Request
from kvgate.scheduler.state import SchedulerState


class Strategy(Protocol):
    name: str

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None: ...

    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool: ...


def promises(strategy: Strategy) -> frozenset[Invariant]:
    """The invariants ``strategy``'s own rules promise (all of them unless it says otherwise)."""
    promised = getattr(strategy, "promises", ALL_INVARIANTS)
    if not isinstance(promised, frozenset):
        raise TypeError(f"{strategy.name}.promises must be a frozenset of Invariant")
    return frozenset(Invariant(p) for p in promised)


class KvgateStrategy:
    name = "kvgate"
    promises = ALL_INVARIANTS

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        self.admit(state, builder)
        batch.select_rows(state, builder, self)

    def admit(self, state: SchedulerState, builder: PlanBuilder) -> None:
        admission.admit(state, builder)

    def make_room(
        self, state: SchedulerState, builder: PlanBuilder, requester: Request, blocks_short: int
    ) -> bool:
        """Evict so that ``blocks_short`` more blocks are free for ``requester``'s next row —
        all of it, or nothing when that is impossible (no ineffective preemption)."""
        victims = find_victims(
            state, requester, blocks_short, False, EvictionReason.GROWTH, builder
        )
        if victims is None:
            return False
        evict_all(state, victims, requester, EvictionReason.GROWTH, builder)
        return True
