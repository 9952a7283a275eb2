"""One reconcile step for a pool's executors, as a pure function of what was observed.

``plan()`` reads the desired size and revision, the executor Pods and the admission service's
membership, and returns what to do now and the status to report. It never waits: waiting is
"nothing to do yet, look again later", which the caller turns into a retry. Levels, not edges:
the same observations always give the same plan, so a crash between any two actions is repaired
by the next pass.

The rules, in the order they apply::

    stopped pod (Failed/Succeeded)        delete now; its slot is recreated on the next pass
    drain in progress (pod annotated)     wait until the service reports it drained, holds no
                                          work, or the drain timeout passes; then remove it
    surplus (slot >= replicas) or
    outdated (revision differs)           not serving: delete now (it holds no work)
                                          serving: drain one at a time, surplus first, highest
                                          slot first; an outdated pod only while every other
                                          slot is served (at most one executor out at a time)
    missing slot                          create (all at once: new capacity is never a risk)
    membership                            the ready pods with an IP, the draining ones flagged

A pod leaves the membership before it is deleted, so the admission service never sees a member
vanish without being told.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from kvgate.admission_service.admin_api import ExecutorSpec, ExecutorState, ExecutorStatus
from kvgate.operator.naming import executor_pod_name, step_endpoint
from kvgate.operator.observe import ObservedPod, PodPhase
from kvgate.operator.status import (
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    ExecutorEntry,
    Phase,
)

_STOPPED = (PodPhase.FAILED, PodPhase.SUCCEEDED)
_DRAINING_STATES = (ExecutorState.DRAINING, ExecutorState.DRAINED)


class Cause(StrEnum):
    """Why an executor leaves the pool."""

    STOPPED = "stopped"  # the pod stopped running: it is replaced, no drain possible
    SCALE_DOWN = "scale-down"
    UPDATE = "update"


class Removal(StrEnum):
    """How a leaving executor's work was dealt with before its pod is deleted."""

    DRAINED = "drained"
    DRAIN_TIMEOUT = "drain-timeout"
    NOT_SERVING = "not-serving"  # not ready or not a member: it held no work
    STOPPED = "stopped"


@dataclass(frozen=True)
class PlanInput:
    pool: str
    replicas: int
    revision: str
    pods: Sequence[ObservedPod]
    membership: Sequence[ExecutorStatus] | None  # None: the admin API did not answer
    now: datetime
    drain_timeout: timedelta
    admin_problem: str = ""
    admission_paused: bool = False  # spec.admission.replicas is 0: membership is left alone


@dataclass(frozen=True)
class DrainStart:
    name: str
    cause: Cause
    mark: bool  # True: annotate the pod first; False: it is marked, only repeat the call


@dataclass(frozen=True)
class Deletion:
    name: str
    uid: str
    cause: Cause
    removal: Removal


@dataclass(frozen=True)
class Plan:
    drains: tuple[DrainStart, ...]
    membership: tuple[ExecutorSpec, ...] | None  # None: leave the membership as it is
    deletions: tuple[Deletion, ...]
    creations: tuple[int, ...]  # slots
    converged: bool  # once this plan is carried out, the pool is what its spec asks for
    draining: bool  # an executor is (still) draining: look again soon
    phase: Phase
    executors: tuple[ExecutorEntry, ...]
    ready_replicas: int
    updated_replicas: int
    live_replicas: int
    conditions: tuple[ConditionUpdate, ...]


def _drain_verdict(
    pod: ObservedPod, members: Mapping[str, ExecutorStatus] | None, inp: PlanInput
) -> Removal | None:
    """How a draining pod may go now, or None while it must keep draining."""
    assert pod.draining_since is not None
    member = members.get(pod.name) if members is not None else None
    if members is not None and member is None:
        return Removal.NOT_SERVING
    if not pod.ready or (member is not None and member.state is ExecutorState.LOST):
        return Removal.NOT_SERVING  # the service already treats its work as lost
    if member is not None and member.state is ExecutorState.DRAINED:
        return Removal.DRAINED
    if inp.now - pod.draining_since >= inp.drain_timeout:
        return Removal.DRAIN_TIMEOUT
    return None


def _by_slot_desc(pod: ObservedPod) -> tuple[int, str]:
    return (-1 if pod.slot is None else pod.slot, pod.name)


def plan(inp: PlanInput) -> Plan:
    members = {m.name: m for m in inp.membership} if inp.membership is not None else None
    live = [p for p in inp.pods if not p.terminating]
    names_taken = {p.name for p in inp.pods}

    deletions = [
        Deletion(p.name, p.uid, Cause.STOPPED, Removal.STOPPED) for p in live if p.phase in _STOPPED
    ]
    alive = sorted((p for p in live if p.phase not in _STOPPED), key=lambda p: p.name)

    # Slot owners are the pods named for a slot in range; anything else alive is surplus.
    owners: dict[int, ObservedPod] = {}
    surplus: list[ObservedPod] = []
    for pod in alive:
        slot = pod.slot
        if (
            slot is not None
            and slot < inp.replicas
            and pod.name == executor_pod_name(inp.pool, slot)
        ):
            owners[slot] = pod
        else:
            surplus.append(pod)
    outdated = [p for p in owners.values() if p.revision != inp.revision]
    cause = {p.name: Cause.SCALE_DOWN for p in surplus} | {p.name: Cause.UPDATE for p in outdated}

    # Drains already under way.
    drains: list[DrainStart] = []
    still_draining: list[ObservedPod] = []
    for pod in alive:
        if pod.draining_since is None:
            continue
        removal = _drain_verdict(pod, members, inp)
        why = cause.get(pod.name, Cause.UPDATE)
        if removal is not None:
            deletions.append(Deletion(pod.name, pod.uid, why, removal))
            continue
        still_draining.append(pod)
        member = members.get(pod.name) if members is not None else None
        if member is not None and member.state not in _DRAINING_STATES:
            drains.append(DrainStart(pod.name, why, mark=False))  # the service forgot it

    # Leaving pods that are not serving go at once; one serving pod starts draining.
    candidates = sorted(
        (p for p in surplus if p.draining_since is None), key=_by_slot_desc, reverse=True
    ) + sorted((p for p in outdated if p.draining_since is None), key=_by_slot_desc, reverse=True)
    serving: list[ObservedPod] = []
    for pod in candidates:
        if not pod.ready or (members is not None and pod.name not in members):
            deletions.append(Deletion(pod.name, pod.uid, cause[pod.name], Removal.NOT_SERVING))
        else:
            serving.append(pod)
    leaving = {d.name for d in deletions}
    if not still_draining and serving and members is not None:
        victim = serving[0]
        others_served = all(
            slot in owners and owners[slot].ready and owners[slot].name not in leaving
            for slot in range(inp.replicas)
            if slot != victim.slot
        )
        # Scale-down was asked for; an update must keep every other slot serving.
        if cause[victim.name] is Cause.SCALE_DOWN or others_served:
            drains.append(DrainStart(victim.name, cause[victim.name], mark=True))

    creations = tuple(
        slot
        for slot in range(inp.replicas)
        if slot not in owners and executor_pod_name(inp.pool, slot) not in names_taken
    )

    draining_names = {p.name for p in still_draining} | {d.name for d in drains}
    remaining = [p for p in alive if p.name not in leaving]
    desired = tuple(
        ExecutorSpec(
            name=p.name, endpoint=step_endpoint(p.pod_ip), draining=p.name in draining_names
        )
        for p in remaining
        if p.ready and p.pod_ip is not None
    )
    membership = None
    if inp.membership is not None and not inp.admission_paused:
        current = {(m.name, m.endpoint, m.state in _DRAINING_STATES) for m in inp.membership}
        if current != {(e.name, e.endpoint, e.draining) for e in desired}:
            membership = desired

    owners_left = {s: p for s, p in owners.items() if p.name not in leaving}
    ready = sum(1 for p in owners_left.values() if p.ready)
    updated = sum(1 for p in owners_left.values() if p.revision == inp.revision)
    converged = (
        not deletions
        and not drains
        and not still_draining
        and not creations
        and not surplus
        and not outdated
        and ready == inp.replicas == len(owners)
        and members is not None
    )
    executors = tuple(
        ExecutorEntry(
            name=p.name,
            slot=p.slot,
            revision=p.revision,
            endpoint=step_endpoint(p.pod_ip) if p.pod_ip is not None else None,
            ready=p.ready,
            draining=p.name in draining_names,
        )
        for p in sorted(remaining, key=_by_slot_desc)
    )
    facts = _Facts(
        inp=inp,
        deletions=deletions,
        drains=drains,
        still_draining=still_draining,
        creations=creations,
        surplus=surplus,
        outdated=outdated,
        ready=ready,
        updated=updated,
        members_known=members is not None,
        desired_members=len(desired),
        converged=converged,
    )
    if converged:
        phase = Phase.READY
    elif ready == 0 and inp.replicas > 0:
        phase = Phase.PENDING
    else:
        phase = Phase.PROGRESSING
    return Plan(
        drains=tuple(drains),
        membership=membership,
        deletions=tuple(deletions),
        creations=creations,
        converged=converged,
        draining=bool(draining_names),
        phase=phase,
        executors=executors,
        ready_replicas=ready,
        updated_replicas=updated,
        live_replicas=len(remaining),
        conditions=_conditions(facts),
    )


@dataclass(frozen=True)
class _Facts:
    inp: PlanInput
    deletions: list[Deletion]
    drains: list[DrainStart]
    still_draining: list[ObservedPod]
    creations: tuple[int, ...]
    surplus: list[ObservedPod]
    outdated: list[ObservedPod]
    ready: int
    updated: int
    members_known: bool
    desired_members: int
    converged: bool


def _progress(f: _Facts) -> tuple[str, str]:
    """(reason, message) of the first thing the pool is waiting for."""
    inp = f.inp
    if f.still_draining or f.drains:
        names = [p.name for p in f.still_draining] + [d.name for d in f.drains if d.mark]
        return "Draining", f"draining {', '.join(sorted(set(names)))}"
    if any(d.cause is Cause.STOPPED for d in f.deletions):
        stopped = sorted(d.name for d in f.deletions if d.cause is Cause.STOPPED)
        return "ReplacingStopped", f"replacing stopped executors {', '.join(stopped)}"
    if f.surplus:
        return "ScalingDown", f"{len(f.surplus)} executors above {inp.replicas} replicas to remove"
    if f.outdated:
        return "RollingUpdate", f"{f.updated}/{inp.replicas} executors at revision {inp.revision}"
    if f.creations:
        created = ", ".join(executor_pod_name(inp.pool, s) for s in f.creations)
        return "Creating", f"creating {created}"
    if f.ready < inp.replicas:
        return "WaitingForExecutors", f"{f.ready}/{inp.replicas} executors ready"
    if not f.members_known:
        return "AdminUnavailable", f"admission admin API unavailable: {inp.admin_problem}"
    return "Complete", f"{f.ready}/{inp.replicas} executors ready at revision {inp.revision}"


def _conditions(f: _Facts) -> tuple[ConditionUpdate, ...]:
    reason, message = _progress(f)
    true, false = ConditionStatus.TRUE, ConditionStatus.FALSE
    conditions = [
        ConditionUpdate(
            type=ConditionType.READY,
            status=true if f.converged else false,
            reason="AllExecutorsReady" if f.converged else reason,
            message=message,
        ),
        ConditionUpdate(
            type=ConditionType.PROGRESSING,
            status=false if f.converged else true,
            reason=reason,
            message=message,
        ),
        _admission_condition(f),
    ]
    drain_condition = _drain_condition(f)
    if drain_condition is not None:
        conditions.append(drain_condition)
    return tuple(conditions)


def _admission_condition(f: _Facts) -> ConditionUpdate:
    if f.inp.admission_paused:
        return ConditionUpdate(
            type=ConditionType.ADMISSION_SYNCED,
            status=ConditionStatus.FALSE,
            reason="AdmissionScaledToZero",
            message="spec.admission.replicas is 0: no requests are admitted",
        )
    if not f.members_known:
        return ConditionUpdate(
            type=ConditionType.ADMISSION_SYNCED,
            status=ConditionStatus.FALSE,
            reason="AdminUnavailable",
            message=f.inp.admin_problem,
        )
    return ConditionUpdate(
        type=ConditionType.ADMISSION_SYNCED,
        status=ConditionStatus.TRUE,
        reason="MembershipSynced",
        message=f"{f.desired_members} executors in the admission service's membership",
    )


def _drain_condition(f: _Facts) -> ConditionUpdate | None:
    """Draining is True while an executor drains; afterwards it says how the last one ended."""
    timeout_s = int(f.inp.drain_timeout.total_seconds())
    draining = [
        f"{p.name} draining since {p.draining_since.isoformat()}"
        for p in f.still_draining
        if p.draining_since is not None
    ] + [f"{d.name} draining ({d.cause})" for d in f.drains if d.mark]
    if draining:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.TRUE,
            reason="DrainInProgress",
            message=f"{'; '.join(draining)} (timeout {timeout_s}s)",
        )
    timed_out = [d.name for d in f.deletions if d.removal is Removal.DRAIN_TIMEOUT]
    if timed_out:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.FALSE,
            reason="DrainTimeout",
            message=f"{', '.join(timed_out)} did not drain within {timeout_s}s; removed anyway",
        )
    drained = [d.name for d in f.deletions if d.removal is Removal.DRAINED]
    if drained:
        return ConditionUpdate(
            type=ConditionType.DRAINING,
            status=ConditionStatus.FALSE,
            reason="Drained",
            message=f"{', '.join(drained)} drained and removed",
        )
    return None
