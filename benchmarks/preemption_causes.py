"""Where kvgate's preemptions come from: a strategy that records each one with its circumstances.

``CauseRecorder`` plans exactly like ``KvgateStrategy`` (or a given configuration of it) and, for
every preemption of a step, notes what the victim was doing when it was taken: still filling,
how many tokens it had left, whether it had been preempted before and how recently it had been
restored. ``bench_livelock.py --causes`` prints the tally.

It also notes each request's time to first token in steps, per priority: the first plan that
sees an output token (so one step late, alike for every configuration compared).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvgate.scheduler.plan import PlanBuilder
from kvgate.scheduler.state import SchedulerState
from kvgate.scheduler.strategy import KvgateStrategy

NEAR_DONE_TOKENS = 3  # "close to finishing": at most this many output tokens left


@dataclass(frozen=True, slots=True)
class _Before:
    filling: bool
    tokens_left: int
    preempted_before: bool
    restored_step: int | None


class CauseRecorder(KvgateStrategy):
    """``KvgateStrategy`` that tallies its preemptions by cause into ``causes``."""

    def __init__(self) -> None:
        self.causes: Counter[str] = Counter()
        self.first_token_steps: dict[str, tuple[int, int]] = {}  # id -> (priority, steps)

    def plan_step(self, state: SchedulerState, builder: PlanBuilder) -> None:
        for request in state.requests.values():
            if request.output_token_ids and request.request_id not in self.first_token_steps:
                waited = state.step - request.arrival_step
                self.first_token_steps[request.request_id] = (request.spec.priority, waited)
        before = {
            r.request_id: _Before(
                filling=r.fill is not None,
                tokens_left=r.spec.sampling.max_tokens - len(r.output_token_ids),
                preempted_before=r.num_preemptions > 0,
                restored_step=r.restored_step,
            )
            for r in state.running
        }
        super().plan_step(state, builder)
        window = state.config.min_residency_steps
        for preemption in builder.report.preemptions:
            victim = before[preemption.victim_id]
            tally = self.causes
            tally["total"] += 1
            tally[f"reason: {preemption.reason.value}"] += 1
            same = preemption.requester_priority_class == preemption.victim_priority_class
            tally["victim of the requester's own class" if same else "victim of a lower class"] += 1
            if victim.filling:
                tally["victim still filling"] += 1
            elif victim.tokens_left <= NEAR_DONE_TOKENS:
                tally[f"victim decoding, <= {NEAR_DONE_TOKENS} tokens left"] += 1
            if victim.preempted_before:
                tally["victim preempted before"] += 1
            restored = victim.restored_step
            if restored is not None and state.step - restored <= 2 * window:
                tally[f"victim restored <= {2 * window} steps earlier"] += 1
