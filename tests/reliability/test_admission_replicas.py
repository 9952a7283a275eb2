"""Two admission replicas share one pool on real Kafka (exactly-once on); one is killed.

The request partitions are shared by the consumer group; the four executors by the operator's
rules (``kvgate.operator.shards``), carried out here by a keeper that plays the operator's part
against the replicas' real admin APIs: it reads each live replica's membership and sends the
releases and then the memberships ``split`` decides, as the reconciler does (the operator's own
loop with a Kubernetes API is ``tests/operator/test_operator_shards.py``). A replica counts as
live while its process runs and ``/readyz`` answers, as a pod's readiness would.

Once both replicas drive two executors and hold work, one is killed (SIGKILL): the keeper gives
its executors to the survivor at once (their sessions are fenced by the newer epoch), the group
gives it the partitions after the session timeout, and every request is answered exactly once.
The time from the kill to the first answer on one of the dead replica's partitions is a figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence

import aiohttp
import pytest

from kvgate.operator import shards
from kvgate.operator.admin import AdminClient, AdminRejected, AdminUnavailable
from kvgate.operator.reconciler import Shards
from kvgate.protocol.admin import ExecutorSpec
from kvgate.sim.backend import SimExecutorConfig
from tests.admission_service.kafka_helpers import read_all
from tests.integration.admission_stack import ADMIN_TOKEN, Service, SimExecutor
from tests.reliability.cluster import Cluster, logged, owned_partitions
from tests.reliability.figures import Figures
from tests.reliability.processes import parse_metrics, poll
from tests.reliability.traffic import read_answers
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(420, func_only=True)

GEOMETRY = {"num_blocks": 128, "block_size": 8}
PARTITIONS = 4


class Keeper:
    """The operator's membership rules for several replicas, run against live services."""

    def __init__(self, services: Sequence[Service], executors: Sequence[SimExecutor]) -> None:
        self.services = {s.process.name: s for s in services}
        self.desired = [ExecutorSpec(name=e.process.name, endpoint=e.endpoint) for e in executors]
        self.memberships: dict[str, tuple[str, ...]] = {}
        self.errors: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def _observe(self, http: aiohttp.ClientSession, name: str) -> shards.Replica:
        service = self.services[name]
        url = service.url("")
        if not service.process.alive:
            return shards.Replica(name, url, ready=False)
        try:
            async with http.get(service.url("/readyz")) as response:
                ready = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ready = False
        if not ready:
            return shards.Replica(name, url, ready=False)
        try:
            reading = await AdminClient(http, url, ADMIN_TOKEN).membership()
        except (AdminUnavailable, AdminRejected) as error:
            return shards.Replica(name, url, ready=True, problem=str(error))
        return shards.Replica(name, url, ready=True, reading=reading)

    async def one_pass(self, http: aiohttp.ClientSession) -> shards.ShardPlan:
        replicas = [await self._observe(http, name) for name in sorted(self.services)]
        plan = shards.split(self.desired, replicas)
        admins = {r.name: AdminClient(http, str(r.url), ADMIN_TOKEN) for r in replicas}
        await Shards(plan, replicas, admins).send()  # the reconciler's own two rounds
        self.memberships = {r: tuple(e.name for e in m) for r, m in plan.memberships.items()}
        return plan

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                try:
                    await self.one_pass(http)
                except (AdminUnavailable, AdminRejected) as error:
                    self.errors.append(repr(error))  # a replica going away: try again
                await asyncio.sleep(0.2)  # the operator's poll interval, not a wait for a result

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _driven(service: Service) -> set[str]:
    """Executors ``service`` has a session with (its executor-state gauge says ready)."""
    samples = parse_metrics(service.metrics())
    ready = set()
    for head, value in samples.items():
        state = head.startswith("kvgate_admission_executor_state{")
        if state and 'state="ready"' in head and value == 1:
            ready.add(head.split('executor="')[1].split('"')[0])
    return ready


@pytest.mark.parametrize("requests", [96, pytest.param(480, marks=pytest.mark.slow, id="full")])
async def test_a_killed_replicas_executors_and_partitions_move_and_nothing_is_lost(
    cluster: Cluster, figures: Figures, requests: int
) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    bodies = mixed_bodies(requests, "r", vocab_size=512, max_tokens=(16, 40))
    reference = sim_reference(bodies, config)
    executors = cluster.sim_executors(
        "exec-0", "exec-1", "exec-2", "exec-3", step_time_ms=10, **GEOMETRY
    )
    kafka = {"partitions": PARTITIONS}
    doomed = cluster.service("replica-a", cluster.settings([], kafka=kafka))
    survivor = cluster.service("replica-b", cluster.settings([], kafka=kafka))
    keeper = Keeper([doomed, survivor], executors)
    keeper.start()
    try:

        def shared() -> bool:
            drives = [_driven(s) for s in (doomed, survivor)]
            taken = [logged(s, "assigned at offset") for s in (doomed, survivor)]
            return all(len(d) == 2 for d in drives) and all(taken)

        await asyncio.to_thread(poll, shared, "two executors and some partitions each", 60)
        doomed_executors = set(keeper.memberships["replica-a"])
        await cluster.send_requests(bodies)
        await read_answers(cluster.bootstrap, cluster.topics.results, requests // 8, settle_s=0)
        doomed_partitions = await asyncio.to_thread(owned_partitions, doomed)
        assert doomed_partitions and not doomed_partitions & owned_partitions(survivor)
        for service in (doomed, survivor):
            held = await asyncio.to_thread(service.metric, "kvgate_admission_requests_in_flight")
            assert held > 0, f"{service.process.name} must be busy when one of them dies"

        killed_at = time.time()
        doomed.process.signal(signal.SIGKILL)
        summary = await cluster.verify(reference, [survivor], executors)
        assert summary.completed == requests
        assert await asyncio.to_thread(owned_partitions, survivor) == set(range(PARTITIONS))
        assert await asyncio.to_thread(_driven, survivor) == {e.process.name for e in executors}
        results, _ = await cluster.answers(settle_s=0)
        # The dead replica's executors served the survivor's requests after the kill.
        served = {name for r in results for name in r.scheduling.executors}
        assert doomed_executors <= served

        records = await read_all(
            cluster.bootstrap, cluster.topics.results, until_count=requests, settle_s=0
        )
        after = [
            r.timestamp / 1000
            for r in records
            if r.partition in doomed_partitions and r.timestamp / 1000 > killed_at
        ]
        figures.record(
            "admission replica killed",
            requests=requests,
            first_answer_on_its_partitions_s=min(after) - killed_at if after else None,
            answers_on_its_partitions_after=len(after),
        )
    finally:
        await keeper.stop()
