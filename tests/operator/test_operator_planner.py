"""The planner: one reconcile step as a pure function, scenario by scenario, then simulated.

The simulation applies plans to a model of the cluster and the admission service until the pool
converges, checking after every step the promises of the rollout: at most one executor drains
at a time, a serving executor is deleted only after it drained (or its drain timed out), and an
update never takes a second executor out of service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.operator import report
from kvgate.operator.observe import ObservedPod, PodPhase
from kvgate.operator.planner import Cause, Plan, PlanInput, Removal, plan
from kvgate.operator.status import ConditionType, Phase
from kvgate.protocol.admin import ExecutorSpec, ExecutorState, ExecutorStatus

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
NEW, OLD = "rev-new", "rev-old"


def pod(
    slot: int,
    *,
    revision: str = NEW,
    ready: bool = True,
    phase: PodPhase = PodPhase.RUNNING,
    name: str | None = None,
    draining_since: datetime | None = None,
    terminating: bool = False,
) -> ObservedPod:
    return ObservedPod(
        name=name or f"pool-{slot}",
        uid=f"uid-{name or slot}-{revision}",
        slot=slot,
        revision=revision,
        phase=phase,
        ready=ready,
        pod_ip=f"10.0.0.{slot}" if phase is PodPhase.RUNNING else None,
        terminating=terminating,
        draining_since=draining_since,
    )


def member(p: ObservedPod, state: ExecutorState = ExecutorState.READY) -> ExecutorStatus:
    return ExecutorStatus(
        name=p.name,
        endpoint=f"ws://{p.pod_ip}:8000/v1/steps",
        state=state,
        running_requests=0,
        waiting_requests=0,
        kv_blocks_used=0,
        kv_blocks_total=64,
    )


def step(
    replicas: int,
    pods: Sequence[ObservedPod],
    members: Sequence[ExecutorStatus] | None,
    *,
    now: datetime = NOW,
    timeout_s: int = 60,
) -> Plan:
    return plan(
        PlanInput(
            pool="pool",
            replicas=replicas,
            revision=NEW,
            pods=pods,
            membership=members,
            now=now,
            drain_timeout=timedelta(seconds=timeout_s),
            admin_problem="connection refused",
        )
    )


def condition(result: Plan, kind: ConditionType) -> tuple[str, str]:
    [found] = [c for c in report.conditions(result) if c.type is kind]
    return found.status.value, found.reason


def test_new_pool_creates_every_slot() -> None:
    result = step(3, [], [])
    assert result.creations == (0, 1, 2)
    assert (result.drains, result.deletions, result.membership) == ((), (), None)
    assert not result.converged and report.phase(result) is Phase.PENDING
    assert condition(result, ConditionType.PROGRESSING) == ("True", "Creating")


def test_ready_executors_join_the_membership() -> None:
    pods = [pod(0), pod(1), pod(2, ready=False)]
    result = step(3, pods, [])
    assert result.membership == tuple(
        ExecutorSpec(name=p.name, endpoint=f"ws://{p.pod_ip}:8000/v1/steps") for p in pods[:2]
    )
    assert not result.converged
    assert condition(result, ConditionType.READY) == ("False", "WaitingForExecutors")


def test_converged_pool_does_nothing() -> None:
    pods = [pod(0), pod(1)]
    result = step(2, pods, [member(p) for p in pods])
    assert (result.creations, result.drains, result.deletions, result.membership) == (
        (),
        (),
        (),
        None,
    )
    assert result.converged and report.phase(result) is Phase.READY
    assert condition(result, ConditionType.READY) == ("True", "AllExecutorsReady")
    assert (result.ready_replicas, result.updated_replicas, result.live_replicas) == (2, 2, 2)


def test_scale_down_drains_the_highest_slot_first() -> None:
    pods = [pod(0), pod(1), pod(2), pod(3)]
    result = step(2, pods, [member(p) for p in pods])
    assert [(d.name, d.cause, d.mark) for d in result.drains] == [
        ("pool-3", Cause.SCALE_DOWN, True)
    ]
    assert result.deletions == ()  # serving executors are never deleted before they drain
    assert result.membership is not None
    assert {e.name: e.draining for e in result.membership} == {
        "pool-0": False,
        "pool-1": False,
        "pool-2": False,
        "pool-3": True,
    }
    assert result.draining and condition(result, ConditionType.DRAINING)[0] == "True"


def test_a_draining_executor_is_waited_for() -> None:
    pods = [pod(0), pod(1, draining_since=NOW - timedelta(seconds=10))]
    members = [member(pods[0]), member(pods[1], ExecutorState.DRAINING)]
    result = step(1, pods, members)
    assert (result.drains, result.deletions, result.creations, result.membership) == (
        (),
        (),
        (),
        None,
    )
    assert result.draining and not result.converged
    assert condition(result, ConditionType.DRAINING) == ("True", "DrainInProgress")


def test_a_drained_executor_leaves_the_membership_and_is_deleted() -> None:
    pods = [pod(0), pod(1, draining_since=NOW - timedelta(seconds=10))]
    members = [member(pods[0]), member(pods[1], ExecutorState.DRAINED)]
    result = step(1, pods, members)
    assert [(d.name, d.removal) for d in result.deletions] == [("pool-1", Removal.DRAINED)]
    assert result.membership is not None
    assert [e.name for e in result.membership] == ["pool-0"]
    assert condition(result, ConditionType.DRAINING) == ("False", "Drained")


def test_a_drain_that_takes_too_long_ends_in_deletion() -> None:
    pods = [pod(0), pod(1, draining_since=NOW - timedelta(seconds=61))]
    members = [member(pods[0]), member(pods[1], ExecutorState.DRAINING)]
    result = step(1, pods, members, timeout_s=60)
    assert [(d.name, d.removal) for d in result.deletions] == [("pool-1", Removal.DRAIN_TIMEOUT)]
    assert condition(result, ConditionType.DRAINING) == ("False", "DrainTimeout")
    # The same drain before the timeout is still waited for.
    assert step(1, pods, members, timeout_s=62).deletions == ()


def test_a_forgotten_drain_is_repeated() -> None:
    """The admission service restarted and lost the drain: the pod's mark carries it."""
    pods = [pod(0), pod(1, draining_since=NOW)]
    result = step(1, pods, [member(pods[0]), member(pods[1], ExecutorState.READY)])
    assert [(d.name, d.mark) for d in result.drains] == [("pool-1", False)]
    assert result.deletions == ()


def test_a_draining_executor_that_is_no_member_holds_no_work() -> None:
    pods = [pod(0), pod(1, draining_since=NOW)]
    result = step(1, pods, [member(pods[0])])
    assert [(d.name, d.removal) for d in result.deletions] == [("pool-1", Removal.NOT_SERVING)]


def test_without_the_admin_api_nothing_new_is_drained() -> None:
    pods = [pod(0), pod(1), pod(2)]
    result = step(2, pods, None)
    assert result.drains == () and result.deletions == () and result.membership is None
    assert condition(result, ConditionType.ADMISSION_SYNCED) == ("False", "AdminUnavailable")
    assert not result.converged
    # A drain under way still ends by its timeout.
    marked = [pod(0), pod(1), pod(2, draining_since=NOW - timedelta(seconds=120))]
    assert [d.removal for d in step(2, marked, None).deletions] == [Removal.DRAIN_TIMEOUT]


def test_rolling_update_drains_one_outdated_executor() -> None:
    pods = [pod(s, revision=OLD) for s in range(3)]
    result = step(3, pods, [member(p) for p in pods])
    assert [(d.name, d.cause) for d in result.drains] == [("pool-2", Cause.UPDATE)]
    assert result.deletions == () and result.creations == ()
    assert condition(result, ConditionType.PROGRESSING) == ("True", "Draining")


def test_rolling_update_waits_while_another_slot_is_not_serving() -> None:
    pods = [pod(0, revision=OLD), pod(1, revision=OLD), pod(2, ready=False)]  # pool-2 starting
    result = step(3, pods, [member(p) for p in pods[:2]])
    assert result.drains == () and result.deletions == ()
    pods_with_gap = [pod(0, revision=OLD), pod(1, revision=OLD)]  # pool-2 not yet recreated
    result = step(3, pods_with_gap, [member(p) for p in pods_with_gap])
    assert result.drains == () and result.creations == (2,)


def test_outdated_executors_that_serve_nothing_are_replaced_at_once() -> None:
    pods = [pod(0, revision=OLD, ready=False), pod(1, revision=OLD, ready=False), pod(2)]
    result = step(3, pods, [member(pods[2])])
    assert sorted((d.name, d.removal) for d in result.deletions) == [
        ("pool-0", Removal.NOT_SERVING),
        ("pool-1", Removal.NOT_SERVING),
    ]
    assert result.drains == ()


def test_stopped_pods_are_deleted_without_drain_and_recreated_later() -> None:
    pods = [pod(0), pod(1, phase=PodPhase.FAILED, ready=False)]
    result = step(2, pods, [member(pods[0])])
    assert [(d.name, d.removal) for d in result.deletions] == [("pool-1", Removal.STOPPED)]
    assert result.drains == ()
    assert result.creations == ()  # the name is still taken until the pod is gone
    assert step(2, pods[:1], [member(pods[0])]).creations == (1,)


def test_a_terminating_pod_holds_its_slot() -> None:
    pods = [pod(0), pod(1, terminating=True)]
    result = step(2, pods, [member(pods[0])])
    assert result.creations == () and result.deletions == ()
    assert [e.name for e in result.executors] == ["pool-0"]


def test_strays_and_surplus_that_serve_nothing_go_at_once() -> None:
    stray = pod(0, name="pool-extra")
    unready_surplus = pod(5, ready=False)
    pods = [pod(0), stray, unready_surplus]
    result = step(1, pods, [member(pods[0])])
    assert sorted(d.name for d in result.deletions) == ["pool-5", "pool-extra"]
    assert all(d.cause is Cause.SCALE_DOWN for d in result.deletions)


def test_executors_appear_in_status_without_the_deleted_ones() -> None:
    pods = [pod(0), pod(1, phase=PodPhase.FAILED, ready=False)]
    result = step(2, pods, [member(pods[0])])
    assert [(e.name, e.ready, e.endpoint) for e in result.executors] == [
        ("pool-0", True, "ws://10.0.0.0:8000/v1/steps")
    ]


# --- simulation -----------------------------------------------------------------------------


@dataclasses.dataclass
class World:
    """The cluster and the admission service as the planner sees them, advanced by plans."""

    pods: dict[str, ObservedPod]
    members: dict[str, ExecutorStatus]
    work: dict[str, int]  # passes until a draining executor is empty
    now: datetime = NOW
    next_ip: int = 100

    def membership(self) -> list[ExecutorStatus]:
        return list(self.members.values())

    def apply(self, result: Plan) -> None:
        for drain in result.drains:
            if drain.mark:
                self.pods[drain.name] = dataclasses.replace(
                    self.pods[drain.name], draining_since=self.now
                )
            self._set_state(drain.name, ExecutorState.DRAINING)
        if result.membership is not None:
            previous = self.members
            self.members = {}
            for spec in result.membership:
                old = previous.get(spec.name)
                state = old.state if old is not None and old.endpoint == spec.endpoint else None
                self.members[spec.name] = ExecutorStatus(
                    name=spec.name,
                    endpoint=spec.endpoint,
                    state=state or ExecutorState.READY,
                    running_requests=0,
                    waiting_requests=0,
                    kv_blocks_used=0,
                    kv_blocks_total=64,
                )
                if spec.draining:
                    self._set_state(spec.name, ExecutorState.DRAINING)
        for deletion in result.deletions:
            del self.pods[deletion.name]
        # Time passes: the kubelet readies the pods that were starting, new pods start.
        self.now += timedelta(seconds=5)
        for name, existing in self.pods.items():
            self.pods[name] = dataclasses.replace(existing, ready=True)
        for slot in result.creations:
            self.next_ip += 1
            created = dataclasses.replace(pod(slot, ready=False), uid=f"uid-{self.next_ip}")
            self.pods[created.name] = dataclasses.replace(created, pod_ip=f"10.0.1.{self.next_ip}")
        # Draining executors finish some of their work.
        for name, status in list(self.members.items()):
            if status.state is ExecutorState.DRAINING:
                self.work[name] = self.work.get(name, 0) - 1
                if self.work[name] <= 0:
                    self._set_state(name, ExecutorState.DRAINED)

    def _set_state(self, name: str, state: ExecutorState) -> None:
        if name in self.members:
            self.members[name] = self.members[name].model_copy(update={"state": state})


def check_step(world: World, result: Plan, replicas: int) -> None:
    """The rollout's promises, checked for one step."""
    leaving = {d.name for d in result.deletions}
    already = [
        p for p in world.pods.values() if p.draining_since is not None and p.name not in leaving
    ]
    new = [d for d in result.drains if d.mark]
    assert len(already) + len(new) <= 1, "two executors draining at once"
    for deletion in result.deletions:
        victim = world.pods[deletion.name]
        serving = victim.ready and victim.name in world.members
        if serving and deletion.removal is not Removal.STOPPED:
            assert victim.draining_since is not None, f"{victim.name} deleted without a drain"
    if any(d.cause is Cause.UPDATE for d in new):
        serving_slots = [
            p
            for p in world.pods.values()
            if p.slot is not None and p.slot < replicas and p.ready and p.draining_since is None
        ]
        assert len(serving_slots) - len(new) >= replicas - 1, "update took two executors out"


def run_to_convergence(world: World, replicas: int, *, passes: int = 200) -> int:
    for count in range(passes):
        result = step(replicas, list(world.pods.values()), world.membership(), now=world.now)
        check_step(world, result, replicas)
        world.apply(result)  # a converged plan may still carry the last membership update
        if result.converged:
            return count
    raise AssertionError(f"not converged after {passes} passes: {world}")


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 6),
    target=st.integers(0, 6),
    outdated=st.sets(st.integers(0, 5)),
    unready=st.sets(st.integers(0, 5)),
    work=st.dictionaries(st.integers(0, 5), st.integers(0, 30)),
)
def test_any_pool_converges_keeping_the_rollout_promises(
    start: int, target: int, outdated: set[int], unready: set[int], work: dict[int, int]
) -> None:
    pods = {
        f"pool-{s}": pod(s, revision=OLD if s in outdated else NEW, ready=s not in unready)
        for s in range(start)
    }
    members = {p.name: member(p) for p in pods.values() if p.ready}
    world = World(pods, members, {f"pool-{s}": n for s, n in work.items()})
    run_to_convergence(world, target)
    assert sorted(world.pods) == [f"pool-{s}" for s in range(target)]
    assert all(p.revision == NEW and p.ready for p in world.pods.values())
    assert {m.name for m in world.members.values()} == set(world.pods)


def test_the_rollout_check_catches_a_planner_that_drains_two_at_once() -> None:
    """check_step can fail: a plan draining two executors together is rejected."""
    pods = {f"pool-{s}": pod(s, revision=OLD) for s in range(3)}
    world = World(pods, {p.name: member(p) for p in pods.values()}, {})
    good = step(3, list(pods.values()), world.membership())
    assert len(good.drains) == 1
    greedy = dataclasses.replace(
        good, drains=(*good.drains, dataclasses.replace(good.drains[0], name="pool-1"))
    )
    try:
        check_step(world, greedy, 3)
    except AssertionError as error:
        assert "two executors draining at once" in str(error)
    else:
        raise AssertionError("check_step accepted two drains at once")


def test_with_the_admission_service_scaled_to_zero_nothing_is_served() -> None:
    pods = [pod(s, revision=OLD) for s in range(2)]
    result = plan(
        PlanInput(
            pool="pool",
            replicas=2,
            revision=NEW,
            pods=pods,
            membership=[],
            now=NOW,
            drain_timeout=timedelta(seconds=60),
            admission_paused=True,
        )
    )
    assert result.membership is None and result.drains == ()
    assert sorted((d.name, d.removal) for d in result.deletions) == [
        ("pool-0", Removal.NOT_SERVING),
        ("pool-1", Removal.NOT_SERVING),
    ]
    assert condition(result, ConditionType.ADMISSION_SYNCED) == ("False", "AdmissionScaledToZero")
