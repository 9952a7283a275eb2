"""Several admission replicas: how the operator shares a pool's executors out (``shards.py``).

The pure rules first (fresh pool, a replica that dies, one that joins, a pool drain, a fenced
copy), then a simulation that carries plans out against replicas that behave like the service
(busy executors drain before they move) over random observations, checking the two promises at
every step: no executor is ever given to a replica while another live replica lists it, and
the shards end balanced with every executor driven by exactly one replica. Last, the reconciler
against three fake admin APIs, one per admission pod, through a join and a death.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import kopf
import pytest

from kvgate.operator import shards
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import KubeApi
from kvgate.operator.naming import COMPONENT_ADMISSION, LABEL_COMPONENT, LABEL_POOL
from kvgate.operator.reconciler import Reconciler
from kvgate.protocol.admin import (
    ExecutorMembership,
    ExecutorSpec,
    ExecutorState,
    ExecutorStatus,
    QueueLoad,
)
from tests.operator.cluster import NAMESPACE, Cluster, admin_token, pool_manifest
from tests.operator.conftest import TOKEN_KEY
from tests.operator.fake_admin import FakeAdminApi
from tests.operator.kube_emulator import KubeEmulator


def spec(name: str, draining: bool = False) -> ExecutorSpec:
    return ExecutorSpec(name=name, endpoint=f"ws://{name}:8000/v1/steps", draining=draining)


def status(
    name: str, state: ExecutorState = ExecutorState.READY, running: int = 0
) -> ExecutorStatus:
    return ExecutorStatus(
        name=name,
        endpoint=f"ws://{name}:8000/v1/steps",
        state=state,
        running_requests=running,
        waiting_requests=0,
        kv_blocks_used=0,
        kv_blocks_total=64,
    )


def replica(
    name: str, *held: ExecutorStatus, ready: bool = True, queue: QueueLoad | None = None
) -> shards.Replica:
    reading = ExecutorMembership(executors=list(held), queue=queue) if ready else None
    return shards.Replica(name, f"http://{name}:8080", ready=ready, reading=reading)


def names(members: tuple[ExecutorSpec, ...]) -> list[str]:
    return sorted(e.name for e in members)


EXECUTORS = [spec(f"e{i}") for i in range(5)]


def test_a_fresh_pool_is_shared_out_evenly_in_one_pass() -> None:
    plan = shards.split(EXECUTORS, [replica("a"), replica("b")])
    assert names(plan.memberships["a"]) == ["e0", "e1", "e3"]
    assert names(plan.memberships["b"]) == ["e2", "e4"]
    assert plan.pushes == ("a", "b") and not plan.releases and not plan.moving


def test_shards_that_match_the_readings_are_left_alone() -> None:
    a = replica("a", status("e1"), status("e2"), status("e4"))
    b = replica("b", status("e0"), status("e3"))
    plan = shards.split(EXECUTORS, [a, b])
    assert plan.settled and not plan.releases
    assert plan.owners == {"e0": "b", "e1": "a", "e2": "a", "e3": "b", "e4": "a"}


def test_a_dead_replicas_executors_go_to_the_survivors_at_once() -> None:
    a = replica("a", status("e0"), status("e1"))
    b = replica("b", status("e2"), status("e3", running=5), status("e4"), ready=False)
    plan = shards.split(EXECUTORS, [a, b])
    assert names(plan.memberships["a"]) == ["e0", "e1", "e2", "e3", "e4"]
    assert plan.pushes == ("a",) and not plan.moving and plan.live == ("a",)


def test_a_joining_replica_gets_busy_executors_only_after_they_drain() -> None:
    a = replica("a", *(status(f"e{i}", running=3) for i in range(5)))
    plan = shards.split(EXECUTORS, [a, replica("b")])
    # b's quota is 2: e3 and e4 (from the end of the names) drain on a first.
    assert plan.moving == ("e3", "e4")
    assert [(e.name, e.draining) for e in plan.memberships["a"]][-2:] == [
        ("e3", True),
        ("e4", True),
    ]
    assert plan.memberships["b"] == ()
    # e3 drained, e4 still busy: a lets e3 go in the first round, b gets it in the second.
    a = replica(
        "a",
        *(status(f"e{i}", running=3) for i in range(3)),
        status("e3", ExecutorState.DRAINED),
        status("e4", ExecutorState.DRAINING, running=1),
    )
    plan = shards.split(EXECUTORS, [a, replica("b")])
    assert names(plan.releases["a"]) == ["e0", "e1", "e2", "e4"]
    assert names(plan.memberships["b"]) == ["e3"] and plan.moving == ("e4",)


def test_an_executor_the_pool_drains_stays_with_its_holder() -> None:
    desired = [*EXECUTORS[:4], spec("e4", draining=True)]
    a = replica("a", *(status(f"e{i}", running=1) for i in range(5)))
    plan = shards.split(desired, [a, replica("b")])
    assert plan.owners["e4"] == "a"
    assert "e4" not in plan.moving
    e4 = next(e for e in plan.memberships["a"] if e.name == "e4")
    assert e4.draining


def test_a_fenced_copy_gives_way_to_the_connected_holder() -> None:
    # b came back after a pause and still lists e0, which a took over (b's session was fenced).
    a = replica("a", status("e0", running=2), status("e1"))
    b = replica("b", status("e0", ExecutorState.LOST), status("e2"))
    plan = shards.split(EXECUTORS[:3], [a, b])
    assert plan.owners["e0"] == "a"
    assert "e0" not in names(plan.releases["b"]) and "e0" not in names(plan.memberships["b"])


def test_the_pool_reading_is_the_union_of_the_holders() -> None:
    a = replica("a", status("e0", running=2), queue=QueueLoad(consumer_lag=5, unplaced=1))
    b = replica(
        "b",
        status("e0", ExecutorState.LOST),
        status("e1"),
        queue=QueueLoad(consumer_lag=7, unplaced=0),
    )
    reading = shards.merged([a, b, replica("c", ready=False)])
    assert reading is not None
    assert [(e.name, e.state, e.running_requests) for e in reading.executors] == [
        ("e0", ExecutorState.READY, 2),
        ("e1", ExecutorState.READY, 0),
    ]
    assert reading.queue == QueueLoad(consumer_lag=12, unplaced=1)
    assert shards.merged([replica("c", ready=False)]) is None


# --- a simulation: plans carried out by replicas that behave like the service ----------------


@dataclass
class SimReplica:
    name: str
    alive: bool = True
    held: dict[str, ExecutorStatus] = field(default_factory=dict)

    def observed(self) -> shards.Replica:
        return replica(self.name, *self.held.values(), ready=self.alive)

    def put(self, members: tuple[ExecutorSpec, ...]) -> None:
        """As ``Membership.set``: leavers stop, joiners connect, drain flags apply."""
        kept = {}
        for e in members:
            s = self.held.get(e.name) or status(e.name)
            if e.draining and s.state is ExecutorState.READY:
                s = s.model_copy(update={"state": ExecutorState.DRAINING})
            elif not e.draining and s.state in (ExecutorState.DRAINING, ExecutorState.DRAINED):
                s = s.model_copy(update={"state": ExecutorState.READY})  # a move called off
            kept[e.name] = s
        self.held = kept


def carry_out(plan: shards.ShardPlan, replicas: dict[str, SimReplica]) -> None:
    for name, kept in plan.releases.items():
        dropped = set(replicas[name].held) - {e.name for e in kept}
        busy = [n for n in dropped if replicas[name].held[n].running_requests > 0]
        assert not busy, f"{name} let go of {busy} with work on them (no drain)"
        replicas[name].put(kept)
    for name in plan.pushes:
        for e in plan.memberships[name]:
            others = [r for r in replicas.values() if r.alive and r.name != name]
            listed = [r.name for r in others if e.name in r.held]
            assert not listed, f"{e.name} given to {name} while {listed} list it"
        replicas[name].put(plan.memberships[name])


@pytest.mark.parametrize("seed", range(40))
def test_random_joins_deaths_and_work_never_share_an_executor(seed: int) -> None:
    rng = random.Random(seed)
    desired = [spec(f"e{i}") for i in range(rng.randint(1, 12))]
    replicas = {n: SimReplica(n) for n in "abcd"[: rng.randint(1, 4)]}
    for _ in range(30):
        event = rng.random()
        if event < 0.15:  # a replica dies (its sessions are fenced by the new owners)
            victim = rng.choice(list(replicas.values()))
            victim.alive, victim.held = False, {}
        elif event < 0.3:  # one comes back, or a new one joins
            dead = [r for r in replicas.values() if not r.alive]
            if dead:
                dead[0].alive = True
            elif len(replicas) < 5:
                name = "abcde"[len(replicas)]
                replicas[name] = SimReplica(name)
        for r in replicas.values():  # work comes and goes
            for name, s in list(r.held.items()):
                busy = rng.random() < 0.5
                state = s.state
                if state is ExecutorState.DRAINING and not busy:
                    state = ExecutorState.DRAINED
                r.held[name] = s.model_copy(
                    update={"state": state, "running_requests": 2 if busy else 0}
                )
        carry_out(shards.split(desired, [r.observed() for r in replicas.values()]), replicas)
    # Then work stops: the shards settle, balanced, every executor driven once.
    live = [r for r in replicas.values() if r.alive]
    if not live:
        return
    for r in live:
        for name, s in r.held.items():
            r.held[name] = s.model_copy(update={"running_requests": 0})
    for _ in range(3):
        plan = shards.split(desired, [r.observed() for r in replicas.values()])
        carry_out(plan, replicas)
    assert shards.split(desired, [r.observed() for r in replicas.values()]).settled
    counts = sorted(len(r.held) for r in live)
    assert counts[-1] - counts[0] <= 1, counts
    driven = sorted(name for r in live for name in r.held)
    assert driven == sorted(e.name for e in desired)


# --- the reconciler with three admission pods, each with its own (fake) admin API -------------


def _loopback_prefix() -> str:
    pid = os.getpid()
    return f"127.{120 + pid % 100}.{(pid // 100) % 250 + 1}"


@dataclass
class Admissions:
    pods: dict[str, FakeAdminApi]
    ips: dict[str, str]


@pytest.fixture
async def admissions(kube: KubeEmulator) -> AsyncIterator[Admissions]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    prefix = _loopback_prefix()
    pods, ips = {}, {}
    for i, name in enumerate(["pool-admission-a", "pool-admission-b", "pool-admission-c"]):
        api = FakeAdminApi(
            token=lambda: admin_token(kube, "pool"), sequence=kube.sequence, changed=kube.changed
        )
        ips[name] = f"{prefix}.{i + 1}"
        await api.start(ips[name], port)
        pods[name] = api
    try:
        yield Admissions(pods, ips)
    finally:
        for api in pods.values():
            await api.stop()


async def _admission_pod(cluster: Cluster, name: str, ip: str, ready: bool = True) -> None:
    labels = {LABEL_POOL: "pool", LABEL_COMPONENT: COMPONENT_ADMISSION}
    if cluster.api.get("v1/pods", NAMESPACE, name) is None:
        cluster.kubelet.held.add(name)
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}}
        body["spec"] = {"containers": [{"name": "admission", "image": "adm:1"}]}
        async with cluster.api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=body) as r:
            assert r.status == 200, await r.text()
    await cluster.kubelet.set_status(
        name, phase="Running" if ready else "Failed", ready=ready, ip=ip
    )


@contextlib.asynccontextmanager
async def _passes(
    cluster: Cluster, kube: KubeEmulator, admissions: Admissions
) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
    """``passes(n)``: n reconcile passes of the real reconciler, each pod started after."""
    template = "http://{pod_ip}:" + admissions.pods["pool-admission-a"].url.rsplit(":", 1)[1]
    config = OperatorConfig(
        admin_url_template="http://127.0.0.1:9/unused",
        admin_pod_url_template=template,
        admission_image="registry.example/adm:1",
        token_key=TOKEN_KEY,
    )

    async def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kube.url))

    kube_api = KubeApi(login, timeout_s=5)
    async with aiohttp.ClientSession() as session:
        reconciler = Reconciler(kube_api, session, config, lambda *_, **__: None)

        async def passes(n: int = 6) -> None:
            for _ in range(n):
                await reconciler.reconcile(NAMESPACE, "pool")
                await cluster.wait_for(lambda: not cluster.kubelet.pending())

        try:
            yield passes
        finally:
            await kube_api.close()


async def test_a_replica_without_executors_is_named_in_the_status(
    cluster: Cluster, kube: KubeEmulator, admissions: Admissions
) -> None:
    async with _passes(cluster, kube, admissions) as passes:
        await cluster.create(pool_manifest(replicas=1, admission={"replicas": 2}))
        await passes(1)
        for name in ("pool-admission-a", "pool-admission-b"):
            await _admission_pod(cluster, name, admissions.ips[name])
        await passes(6)
        synced = cluster.condition("AdmissionSynced")
        assert synced["reason"] == "ReplicasWithoutExecutors", synced
        assert "pool-admission-b drive none" in synced["message"]
        await cluster.patch_spec("pool", {"replicas": 2})
        await passes(6)
        synced = cluster.condition("AdmissionSynced")
        assert synced["reason"] == "MembershipSynced", synced
        assert synced["message"] == "2 executors shared by 2 admission replicas"


async def test_the_reconciler_shares_executors_out_and_moves_them_safely(
    cluster: Cluster, kube: KubeEmulator, admissions: Admissions
) -> None:
    a, b, c = (admissions.pods[f"pool-admission-{x}"] for x in "abc")
    held = lambda api: sorted(api.members)  # noqa: E731
    async with _passes(cluster, kube, admissions) as passes:
        await cluster.create(pool_manifest(replicas=4, admission={"replicas": 3}))
        await passes(1)
        for name in ("pool-admission-a", "pool-admission-b"):
            await _admission_pod(cluster, name, admissions.ips[name])
        await passes()
        executors = [f"pool-{i}" for i in range(4)]
        assert sorted(held(a) + held(b)) == executors
        assert len(held(a)) == len(held(b)) == 2
        status = cluster.status()
        assert {e["name"]: e["admission"] for e in status["executors"]} == {
            **dict.fromkeys(held(a), "pool-admission-a"),
            **dict.fromkeys(held(b), "pool-admission-b"),
        }

        # c joins while every executor is busy: one of a's or b's drains first.
        for api in (a, b):
            for name in held(api):
                api.set_running(name, 2)
        await _admission_pod(cluster, "pool-admission-c", admissions.ips["pool-admission-c"])
        await passes(2)
        assert held(c) == []
        draining = [
            (api, n)
            for api in (a, b)
            for n, m in api.members.items()
            if m.state is ExecutorState.DRAINING
        ]
        assert len(draining) == 1
        giver, moving = draining[0]
        giver.set_running(moving, 0)
        await passes(2)
        assert held(c) == [moving] and moving not in held(giver)
        released = max(call.seq for call in giver.calls("PUT") if moving not in str(call.body))
        given = min(call.seq for call in c.calls("PUT") if moving in str(call.body))
        assert released < given  # the old replica let go before the new one was told

        # b dies: its executors go to a and c without a drain.
        b_had = held(b)
        for name in b_had:
            b.set_running(name, 3)
        await _admission_pod(
            cluster, "pool-admission-b", admissions.ips["pool-admission-b"], ready=False
        )
        await passes(1)
        assert sorted(held(a) + held(c)) == executors
        assert abs(len(held(a)) - len(held(c))) <= 1
        assert set(b_had) <= set(held(a) + held(c))
