"""What a pass reports: the pool's status, the status of a refused pool, Events.

Pure functions of what the pass observed and planned; the reconciler writes and posts them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvgate.operator import planner
from kvgate.operator.models import ExecutorPoolSpec
from kvgate.operator.naming import COMPONENT_EXECUTOR, LABEL_COMPONENT, LABEL_POOL
from kvgate.operator.observe import ObservedPool
from kvgate.operator.status import (
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    Phase,
    PoolStatus,
    merge_conditions,
)


def executor_selector(pool: str) -> dict[str, str]:
    """The labels of a pool's executor pods."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: COMPONENT_EXECUTOR}


def pool_status(pool: ObservedPool, plan: planner.Plan, revision: str, now: datetime) -> PoolStatus:
    selector = executor_selector(pool.name)
    return PoolStatus(
        phase=plan.phase,
        observed_generation=pool.generation,
        replicas=plan.live_replicas,
        ready_replicas=plan.ready_replicas,
        updated_replicas=plan.updated_replicas,
        revision=revision,
        selector=",".join(f"{key}={value}" for key, value in sorted(selector.items())),
        executors=list(plan.executors),
        conditions=merge_conditions(
            pool.conditions, plan.conditions, now=now, generation=pool.generation
        ),
    )


def problem_status_patch(
    pool: ObservedPool, phase: Phase, reason: str, message: str, *, now: datetime
) -> dict[str, Any] | None:
    """A status patch saying Ready=False for ``reason`` (the rest of the status stays as it
    was: the executors are left alone), or None when the status says so already."""
    updates = [
        ConditionUpdate(type=kind, status=ConditionStatus.FALSE, reason=reason, message=message)
        for kind in (ConditionType.READY, ConditionType.PROGRESSING)
    ]
    conditions = merge_conditions(pool.conditions, updates, now=now, generation=pool.generation)
    current = [c.model_dump(mode="json", by_alias=True) for c in pool.conditions]
    wanted = [c.model_dump(mode="json", by_alias=True) for c in conditions]
    if (
        current == wanted
        and pool.status.get("phase") == phase.value
        and pool.status.get("observedGeneration") == pool.generation
    ):
        return None
    return {
        "status": {
            "phase": phase.value,
            "observedGeneration": pool.generation,
            "conditions": wanted,
        }
    }


def deletion_event(deletion: planner.Deletion, spec: ExecutorPoolSpec) -> tuple[str, str, str]:
    """(type, reason, message) of the Event for a deleted executor pod."""
    name = deletion.name
    match deletion.removal:
        case planner.Removal.STOPPED:
            return "Warning", "ExecutorStopped", f"{name} stopped running; replacing it"
        case planner.Removal.DRAIN_TIMEOUT:
            return (
                "Warning",
                "DrainTimeout",
                f"{name} did not drain within {spec.drain_timeout_seconds}s; deleted anyway "
                f"({deletion.cause}); its requests are recomputed elsewhere",
            )
        case planner.Removal.DRAINED:
            return "Normal", "ExecutorRemoved", f"{name} drained and deleted ({deletion.cause})"
        case planner.Removal.NOT_SERVING:
            return "Normal", "ExecutorRemoved", f"{name} held no work; deleted ({deletion.cause})"
