"""One reconcile step for a pool's executors, as a pure function of what was observed.

``plan()`` reads the desired size and revision, the executor Pods and the admission service's
membership, and returns what to do now with the facts the status is made of (``report`` words
them). It never waits: waiting is
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

from kvgate.operator.naming import executor_pod_name, step_endpoint
from kvgate.operator.observe import ObservedPod, PodPhase
from kvgate.operator.status import ExecutorEntry
from kvgate.protocol.admin import ExecutorSpec, ExecutorState, ExecutorStatus

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
    """What to do now, and the facts the status is made of (see ``report``)."""

    input: PlanInput
    # Actions, in the order they are carried out.
    drains: tuple[DrainStart, ...]
    membership: tuple[ExecutorSpec, ...] | None  # None: leave the membership as it is
    members: tuple[ExecutorSpec, ...]  # the membership the pool should have (``membership``'s
    # update or not): what several admission replicas share out (``shards.py``)
    deletions: tuple[Deletion, ...]
    creations: tuple[int, ...]  # slots
    # Facts.
    converged: bool  # once this plan is carried out, the pool is what its spec asks for
    still_draining: tuple[ObservedPod, ...]  # drains under way that continue
    surplus: int  # pods above the desired slots
    outdated: int  # slot owners at another revision
    executors: tuple[ExecutorEntry, ...]  # the pods that remain, for the status
    ready_replicas: int
    updated_replicas: int
    live_replicas: int
    members_known: bool  # the admin API answered
    desired_members: int

    @property
    def draining(self) -> bool:
        """An executor is draining after this plan: look again soon."""
        return bool(self.still_draining) or any(d.mark for d in self.drains)


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


@dataclass(frozen=True)
class _Pods:
    """The executor pods, sorted out."""

    stopped: list[ObservedPod]  # Failed or Succeeded, not yet terminating
    alive: list[ObservedPod]  # the rest of the pods not terminating
    owners: dict[int, ObservedPod]  # slot -> the pod named for it, for slots in range
    surplus: list[ObservedPod]  # alive, not owning a slot in range
    outdated: list[ObservedPod]  # owners at another revision
    names_taken: set[str]  # every pod name in use, terminating ones included

    @property
    def cause(self) -> dict[str, Cause]:
        return {p.name: Cause.SCALE_DOWN for p in self.surplus} | {
            p.name: Cause.UPDATE for p in self.outdated
        }


def _sort_out(inp: PlanInput) -> _Pods:
    live = [p for p in inp.pods if not p.terminating]
    alive = sorted((p for p in live if p.phase not in _STOPPED), key=lambda p: p.name)
    owners: dict[int, ObservedPod] = {}
    surplus: list[ObservedPod] = []
    for pod in alive:
        slot = pod.slot
        named_for_slot = slot is not None and pod.name == executor_pod_name(inp.pool, slot)
        if named_for_slot and slot is not None and slot < inp.replicas:
            owners[slot] = pod
        else:
            surplus.append(pod)
    return _Pods(
        stopped=[p for p in live if p.phase in _STOPPED],
        alive=alive,
        owners=owners,
        surplus=surplus,
        outdated=[p for p in owners.values() if p.revision != inp.revision],
        names_taken={p.name for p in inp.pods},
    )


def _follow_drains(
    pods: _Pods, members: Mapping[str, ExecutorStatus] | None, inp: PlanInput
) -> tuple[list[Deletion], list[DrainStart], list[ObservedPod]]:
    """Drains under way: (pods that may go now, drain calls to repeat, pods still draining)."""
    deletions: list[Deletion] = []
    repeats: list[DrainStart] = []
    still_draining: list[ObservedPod] = []
    for pod in pods.alive:
        if pod.draining_since is None:
            continue
        why = pods.cause.get(pod.name, Cause.UPDATE)  # a started drain is always finished
        removal = _drain_verdict(pod, members, inp)
        if removal is not None:
            deletions.append(Deletion(pod.name, pod.uid, why, removal))
            continue
        still_draining.append(pod)
        member = members.get(pod.name) if members is not None else None
        if member is not None and member.state not in _DRAINING_STATES:
            repeats.append(DrainStart(pod.name, why, mark=False))  # the service forgot it
    return deletions, repeats, still_draining


def _choose_leavers(
    pods: _Pods,
    members: Mapping[str, ExecutorStatus] | None,
    inp: PlanInput,
    *,
    busy: bool,
    leaving: set[str],
) -> tuple[list[Deletion], list[DrainStart]]:
    """Leaving pods that serve nothing go at once; one serving pod starts draining, unless
    one drains already (``busy``) or the admin API is not answering."""
    cause = pods.cause
    candidates = sorted(
        (p for p in pods.surplus if p.draining_since is None), key=_by_slot_desc, reverse=True
    ) + sorted(
        (p for p in pods.outdated if p.draining_since is None), key=_by_slot_desc, reverse=True
    )
    deletions: list[Deletion] = []
    serving: list[ObservedPod] = []
    for pod in candidates:
        if not pod.ready or (members is not None and pod.name not in members):
            deletions.append(Deletion(pod.name, pod.uid, cause[pod.name], Removal.NOT_SERVING))
        else:
            serving.append(pod)
    if busy or not serving or members is None:
        return deletions, []
    victim = serving[0]
    gone = leaving | {d.name for d in deletions}
    others_served = all(
        slot in pods.owners and pods.owners[slot].ready and pods.owners[slot].name not in gone
        for slot in range(inp.replicas)
        if slot != victim.slot
    )
    # Scale-down was asked for; an update must keep every other slot serving.
    if cause[victim.name] is Cause.SCALE_DOWN or others_served:
        return deletions, [DrainStart(victim.name, cause[victim.name], mark=True)]
    return deletions, []


def _membership(
    inp: PlanInput, remaining: Sequence[ObservedPod], draining: set[str]
) -> tuple[tuple[ExecutorSpec, ...], tuple[ExecutorSpec, ...] | None]:
    """(the membership the service should have, the update to send or None)."""
    desired = tuple(
        ExecutorSpec(name=p.name, endpoint=step_endpoint(p.pod_ip), draining=p.name in draining)
        for p in remaining
        if p.ready and p.pod_ip is not None
    )
    if inp.membership is None or inp.admission_paused:
        return desired, None
    current = {(m.name, m.endpoint, m.state in _DRAINING_STATES) for m in inp.membership}
    if current == {(e.name, e.endpoint, e.draining) for e in desired}:
        return desired, None
    return desired, desired


def plan(inp: PlanInput) -> Plan:
    members = {m.name: m for m in inp.membership} if inp.membership is not None else None
    pods = _sort_out(inp)

    deletions = [Deletion(p.name, p.uid, Cause.STOPPED, Removal.STOPPED) for p in pods.stopped]
    drained, drains, still_draining = _follow_drains(pods, members, inp)
    deletions += drained
    leavers, started = _choose_leavers(
        pods, members, inp, busy=bool(still_draining), leaving={d.name for d in deletions}
    )
    deletions += leavers
    drains += started
    leaving = {d.name for d in deletions}

    creations = tuple(
        slot
        for slot in range(inp.replicas)
        if slot not in pods.owners and executor_pod_name(inp.pool, slot) not in pods.names_taken
    )
    draining_names = {p.name for p in still_draining} | {d.name for d in drains}
    remaining = [p for p in pods.alive if p.name not in leaving]
    desired, membership = _membership(inp, remaining, draining_names)

    owners_left = [p for p in pods.owners.values() if p.name not in leaving]
    ready = sum(1 for p in owners_left if p.ready)
    updated = sum(1 for p in owners_left if p.revision == inp.revision)
    converged = (
        not deletions
        and not drains
        and not still_draining
        and not creations
        and not pods.surplus
        and not pods.outdated
        and ready == inp.replicas == len(pods.owners)
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
    return Plan(
        input=inp,
        drains=tuple(drains),
        membership=membership,
        members=desired,
        deletions=tuple(deletions),
        creations=creations,
        converged=converged,
        still_draining=tuple(still_draining),
        surplus=len(pods.surplus),
        outdated=len(pods.outdated),
        executors=executors,
        ready_replicas=ready,
        updated_replicas=updated,
        live_replicas=len(remaining),
        members_known=members is not None,
        desired_members=len(desired),
    )
