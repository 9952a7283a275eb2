"""What a pass reports: the pool's status and conditions, the status of a refused pool, Events.

Pure functions of what the pass observed and planned; the reconciler writes and posts them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvgate.operator.models import ExecutorPoolSpec
from kvgate.operator.naming import (
    COMPONENT_EXECUTOR,
    LABEL_COMPONENT,
    LABEL_POOL,
    executor_pod_name,
)
from kvgate.operator.observe import ObservedPool
from kvgate.operator.planner import Cause, Deletion, Plan, Removal
from kvgate.operator.shards import ShardPlan
from kvgate.operator.status import (
    AutoscalingStatus,
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


def phase(plan: Plan) -> Phase:
    if plan.converged:
        return Phase.READY
    if plan.ready_replicas == 0 and plan.input.replicas > 0:
        return Phase.PENDING
    return Phase.PROGRESSING


def pool_status(
    pool: ObservedPool,
    plan: Plan,
    now: datetime,
    *,
    autoscaling: AutoscalingStatus | None = None,
    shard: ShardPlan | None = None,
) -> PoolStatus:
    """The status of ``plan``; ``shard``: how several admission replicas share the executors."""
    selector = executor_selector(pool.name)
    updates = conditions(plan)
    owners = shard.owners if shard is not None else None
    if shard is not None and plan.members_known and not plan.input.admission_paused:
        updates = tuple(
            _sharded_condition(plan, shard) if u.type is ConditionType.ADMISSION_SYNCED else u
            for u in updates
        )
    if autoscaling is not None:
        updates = (*updates, _autoscaling_condition(autoscaling))
    return PoolStatus(
        phase=phase(plan),
        observed_generation=pool.generation,
        replicas=plan.live_replicas,
        ready_replicas=plan.ready_replicas,
        updated_replicas=plan.updated_replicas,
        revision=plan.input.revision,
        selector=",".join(f"{key}={value}" for key, value in sorted(selector.items())),
        executors=[
            e.model_copy(update={"admission": owners.get(e.name)}) if owners else e
            for e in plan.executors
        ],
        autoscaling=autoscaling,
        conditions=merge_conditions(pool.conditions, updates, now=now, generation=pool.generation),
    )


def _autoscaling_condition(autoscaling: AutoscalingStatus) -> ConditionUpdate:
    """True while decisions are taken from load readings; the reason says the last one."""
    reading = not autoscaling.reason.startswith("no load reading")
    return ConditionUpdate(
        type=ConditionType.AUTOSCALING,
        status=ConditionStatus.TRUE if reading else ConditionStatus.FALSE,
        reason="ScalingActive" if reading else "NoLoadReading",
        message=f"{autoscaling.desired_replicas} executors: {autoscaling.reason}",
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


def deletion_event(deletion: Deletion, spec: ExecutorPoolSpec) -> tuple[str, str, str]:
    """(type, reason, message) of the Event for a deleted executor pod."""
    name = deletion.name
    match deletion.removal:
        case Removal.STOPPED:
            return "Warning", "ExecutorStopped", f"{name} stopped running; replacing it"
        case Removal.DRAIN_TIMEOUT:
            return (
                "Warning",
                "DrainTimeout",
                f"{name} did not drain within {spec.drain_timeout_seconds}s; deleted anyway "
                f"({deletion.cause}); its requests are recomputed elsewhere",
            )
        case Removal.DRAINED:
            return "Normal", "ExecutorRemoved", f"{name} drained and deleted ({deletion.cause})"
        case Removal.NOT_SERVING:
            return "Normal", "ExecutorRemoved", f"{name} held no work; deleted ({deletion.cause})"


# --- conditions: what the pool is waiting for, in the order it matters -----------------------


def _progress(plan: Plan) -> tuple[str, str]:
    """(reason, message) of the first thing the pool is waiting for."""
    inp = plan.input
    if plan.still_draining or plan.drains:
        names = [p.name for p in plan.still_draining] + [d.name for d in plan.drains if d.mark]
        return "Draining", f"draining {', '.join(sorted(set(names)))}"
    if any(d.cause is Cause.STOPPED for d in plan.deletions):
        stopped = sorted(d.name for d in plan.deletions if d.cause is Cause.STOPPED)
        return "ReplacingStopped", f"replacing stopped executors {', '.join(stopped)}"
    if plan.surplus:
        return "ScalingDown", f"{plan.surplus} executors above {inp.replicas} replicas to remove"
    if plan.outdated:
        return (
            "RollingUpdate",
            f"{plan.updated_replicas}/{inp.replicas} executors at revision {inp.revision}",
        )
    if plan.creations:
        created = ", ".join(executor_pod_name(inp.pool, s) for s in plan.creations)
        return "Creating", f"creating {created}"
    if plan.ready_replicas < inp.replicas:
        return "WaitingForExecutors", f"{plan.ready_replicas}/{inp.replicas} executors ready"
    if not plan.members_known:
        return "AdminUnavailable", f"admission admin API unavailable: {inp.admin_problem}"
    return (
        "Complete",
        f"{plan.ready_replicas}/{inp.replicas} executors ready at revision {inp.revision}",
    )


def conditions(plan: Plan) -> tuple[ConditionUpdate, ...]:
    reason, message = _progress(plan)
    true, false = ConditionStatus.TRUE, ConditionStatus.FALSE
    conditions = [
        ConditionUpdate(
            type=ConditionType.READY,
            status=true if plan.converged else false,
            reason="AllExecutorsReady" if plan.converged else reason,
            message=message,
        ),
        ConditionUpdate(
            type=ConditionType.PROGRESSING,
            status=false if plan.converged else true,
            reason=reason,
            message=message,
        ),
        _admission_condition(plan),
    ]
    drain_condition = _drain_condition(plan)
    if drain_condition is not None:
        conditions.append(drain_condition)
    return tuple(conditions)


def _admission_condition(plan: Plan) -> ConditionUpdate:
    if plan.input.admission_paused:
        return ConditionUpdate(
            type=ConditionType.ADMISSION_SYNCED,
            status=ConditionStatus.FALSE,
            reason="AdmissionScaledToZero",
            message="spec.admission.replicas is 0: no requests are admitted",
        )
    if not plan.members_known:
        return ConditionUpdate(
            type=ConditionType.ADMISSION_SYNCED,
            status=ConditionStatus.FALSE,
            reason="AdminUnavailable",
            message=plan.input.admin_problem,
        )
    return ConditionUpdate(
        type=ConditionType.ADMISSION_SYNCED,
        status=ConditionStatus.TRUE,
        reason="MembershipSynced",
        message=f"{plan.desired_members} executors in the admission service's membership",
    )


def _sharded_condition(plan: Plan, shard: ShardPlan) -> ConditionUpdate:
    """AdmissionSynced of several replicas: how the executors are shared, and which live
    replicas drive none (their partitions' requests wait until one is theirs)."""
    driving = set(shard.owners.values())
    idle = [replica for replica in shard.live if replica not in driving]
    shared = f"{len(shard.owners)} executors shared by {len(shard.live)} admission replicas"
    if idle and plan.desired_members > 0:
        return ConditionUpdate(
            type=ConditionType.ADMISSION_SYNCED,
            status=ConditionStatus.TRUE,
            reason="ReplicasWithoutExecutors",
            message=(
                f"{shared}; {', '.join(idle)} drive none (more replicas than executors): the "
                "requests of their partitions wait"
            ),
        )
    return ConditionUpdate(
        type=ConditionType.ADMISSION_SYNCED,
        status=ConditionStatus.TRUE,
        reason="MembershipSynced",
        message=shared,
    )


def _drain_condition(plan: Plan) -> ConditionUpdate | None:
    """Draining is True while an executor drains; afterwards it says how the last one ended."""
    timeout_s = int(plan.input.drain_timeout.total_seconds())
    draining = [
        f"{p.name} draining since {p.draining_since.isoformat()}"
        for p in plan.still_draining
        if p.draining_since is not None
    ] + [f"{d.name} draining ({d.cause})" for d in plan.drains if d.mark]
    if draining:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.TRUE,
            reason="DrainInProgress",
            message=f"{'; '.join(draining)} (timeout {timeout_s}s)",
        )
    timed_out = [d.name for d in plan.deletions if d.removal is Removal.DRAIN_TIMEOUT]
    if timed_out:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.FALSE,
            reason="DrainTimeout",
            message=f"{', '.join(timed_out)} did not drain within {timeout_s}s; removed anyway",
        )
    drained = [d.name for d in plan.deletions if d.removal is Removal.DRAINED]
    if drained:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.FALSE,
            reason="Drained",
            message=f"{', '.join(drained)} drained and removed",
        )
    return None
