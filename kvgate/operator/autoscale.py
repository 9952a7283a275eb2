"""How many executors a pool should have, as a pure function of its observed load.

``decide()`` turns one load reading of the admission service (consumer lag, requests waiting,
KV-cache use per executor) and the recommendations of the last few minutes into the replica count
to set now. It never reads a clock or an API: the reconciler passes ``now``, and the history
lives in the pool's status, so a restarted operator decides exactly as the one before it would.

The rules, in order:

1. **Proposals**, one per configured target (each rounds up):
   ``lag / targetConsumerLagPerExecutor``, ``(unplaced + waiting) / targetWaitingPerExecutor``,
   and, for KV use, ``reporting executors × used/total / targetKvCacheUsage``. The largest wins:
   a pool is as large as its most pressing signal asks.
2. **Idle and zero**: with ``minReplicas: 0``, a pool with nothing in the queue, waiting or
   running is idle; once it has been idle for ``scaleToZeroAfterSeconds`` the proposal is 0.
   Anything at all in the queue proposes at least one executor — the wake-up on the first
   request (the admission service keeps reading while the pool has no executors).
3. **Bounds**: the proposal is clamped to ``[minReplicas, maxReplicas]``.
4. **Stabilization** (as the HorizontalPodAutoscaler does it): scaling up goes only as high as
   the lowest recommendation of the last ``scaleUpStabilizationSeconds``; scaling down only as
   low as the highest of the last ``scaleDownStabilizationSeconds``. A burst that lasts one
   reading does not shrink the pool behind it, and a flapping signal does not churn pods.
5. **Step cap**: one decision adds at most ``maxScaleUpStep`` executors and removes at most
   ``maxScaleDownStep``, bounding what one step costs (GPUs started, requests drained at once).

Without a load reading (the admin API is down) the count stays where it is: the operator never
scales on what it cannot see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from kvgate.operator.models import AutoscalingSpec
from kvgate.protocol.admin import ExecutorStatus, QueueLoad

# Recommendations kept in the status (distinct consecutive values only, newest last).
MAX_HISTORY = 256


@dataclass(frozen=True, slots=True)
class Recommendation:
    at: datetime
    replicas: int


@dataclass(frozen=True, slots=True)
class Load:
    """One reading of the pool's admission service."""

    queue: QueueLoad
    executors: Sequence[ExecutorStatus]

    @property
    def waiting(self) -> int:
        return self.queue.unplaced + sum(e.waiting_requests for e in self.executors)

    @property
    def running(self) -> int:
        return sum(e.running_requests for e in self.executors)

    @property
    def idle(self) -> bool:
        return self.queue.consumer_lag == 0 and self.waiting == 0 and self.running == 0


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # one line: which signal asked for what, and what bounded it
    history: tuple[Recommendation, ...]  # to store, newest last
    idle_since: datetime | None  # to store: when the pool was first seen idle, this stretch


def decide(
    spec: AutoscalingSpec,
    *,
    current: int,
    load: Load | None,
    history: Sequence[Recommendation],
    idle_since: datetime | None,
    now: datetime,
) -> Decision:
    if load is None:
        return Decision(current, "no load reading: keeping the count", tuple(history), idle_since)
    proposal, why = _proposal(spec, load)
    idle_since = (idle_since or now) if load.idle else None
    if idle_since is not None and spec.min_replicas == 0:
        idle_for = (now - idle_since).total_seconds()
        if idle_for >= spec.scale_to_zero_after_seconds:
            proposal, why = 0, f"idle for {idle_for:.0f} s"
        else:
            proposal = max(proposal, min(current, 1))
            why = f"idle for {idle_for:.0f} s of {spec.scale_to_zero_after_seconds} before zero"
    bounded = min(max(proposal, spec.min_replicas), spec.max_replicas)
    if bounded != proposal:
        why += f"; bounded to [{spec.min_replicas}, {spec.max_replicas}]"
    window = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    kept = [r for r in history if now - r.at < timedelta(seconds=window)]
    if kept and kept[-1].replicas == bounded:
        kept.pop()  # the newer equal one stands for it in every window: status stays small
    history = (*kept[-(MAX_HISTORY - 1) :], Recommendation(now, bounded))
    target = _stabilized(spec, current, history, now)
    if target != bounded:
        why += f"; stabilized at {target}"
    if target > current + spec.max_scale_up_step:
        target = current + spec.max_scale_up_step
        why += f"; at most {spec.max_scale_up_step} more per step"
    elif target < current - spec.max_scale_down_step:
        target = current - spec.max_scale_down_step
        why += f"; at most {spec.max_scale_down_step} fewer per step"
    return Decision(target, why, history, idle_since)


def _proposal(spec: AutoscalingSpec, load: Load) -> tuple[int, str]:
    """The largest replica count any configured target asks for, and which one it was."""
    asks: list[tuple[int, str]] = []
    lag = load.queue.consumer_lag
    if spec.target_consumer_lag_per_executor is not None:
        target = spec.target_consumer_lag_per_executor
        asks.append((math.ceil(lag / target), f"consumer lag {lag} (target {target} each)"))
    if spec.target_waiting_per_executor is not None:
        target = spec.target_waiting_per_executor
        waiting = load.waiting
        asks.append((math.ceil(waiting / target), f"{waiting} waiting (target {target} each)"))
    if spec.target_kv_cache_usage is not None:
        reporting = [e for e in load.executors if e.kv_blocks_total > 0]
        if reporting:
            used = sum(e.kv_blocks_used for e in reporting)
            usage = used / sum(e.kv_blocks_total for e in reporting)
            target_usage = spec.target_kv_cache_usage
            # Rounding guard: 2 executors at exactly the target ask for 2, not 3.
            count = math.ceil(len(reporting) * usage / target_usage - 1e-9)
            asks.append((count, f"KV cache {usage:.0%} used (target {target_usage:.0%})"))
    if not load.idle:
        asks.append((1, "work in the pool"))  # wake-up: never zero executors while work waits
    if not asks:
        return 0, "no load"
    return max(asks, key=lambda ask: ask[0])


def _stabilized(
    spec: AutoscalingSpec, current: int, history: Sequence[Recommendation], now: datetime
) -> int:
    def within(seconds: int) -> list[int]:
        return [r.replicas for r in history if now - r.at <= timedelta(seconds=seconds)]

    newest = history[-1].replicas
    if newest > current:
        return max(min(within(spec.scale_up_stabilization_seconds)), current)
    if newest < current:
        return min(max(within(spec.scale_down_stabilization_seconds)), current)
    return current
