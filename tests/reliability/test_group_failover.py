"""Scenario 4: two admission instances in one consumer group; one is killed (SIGKILL).

Each instance drives its own simulated executor. Once both own partitions and both have work
in flight, one is killed: after its session times out the group moves its partitions to the
survivor, whose partition producers fence the dead one's open transactions, and whose results
scan skips what the dead one had already committed. Every request is answered exactly once.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from kvgate.sim.backend import SimExecutorConfig
from tests.reliability.cluster import Cluster, logged, owned_partitions
from tests.reliability.processes import poll
from tests.reliability.traffic import read_answers
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(420, func_only=True)

GEOMETRY = {"num_blocks": 128, "block_size": 8}
PARTITIONS = 4


@pytest.mark.parametrize("requests", [80, pytest.param(400, marks=pytest.mark.slow, id="full")])
async def test_killed_instance_partitions_move_and_requests_complete_once(
    cluster: Cluster, requests: int
) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    bodies = mixed_bodies(requests, "g", vocab_size=512, max_tokens=(16, 40))
    reference = sim_reference(bodies, config)
    exec_a, exec_b = cluster.sim_executors("exec-a", "exec-b", step_time_ms=10, **GEOMETRY)
    kafka = {"partitions": PARTITIONS}
    doomed = cluster.service("service-a", cluster.settings([exec_a], kafka=kafka))
    survivor = cluster.service("service-b", cluster.settings([exec_b], kafka=kafka))
    # The group has split the partitions between them before any request is produced.
    await asyncio.to_thread(poll, lambda: logged(doomed, "revoked"), "the first rebalance")
    await asyncio.to_thread(
        poll, lambda: logged(survivor, "assigned at offset"), "the second instance's share"
    )
    await cluster.send_requests(bodies)
    await read_answers(cluster.bootstrap, cluster.topics.results, requests // 8, settle_s=0)
    for service in (doomed, survivor):
        in_flight = await asyncio.to_thread(service.metric, "kvgate_admission_requests_in_flight")
        assert in_flight > 0, f"{service.process.name} must be busy when one of them dies"

    doomed.process.signal(signal.SIGKILL)
    summary = await cluster.verify(reference, [survivor], [exec_a, exec_b])
    assert summary.completed == requests
    assert await asyncio.to_thread(owned_partitions, survivor) == set(range(PARTITIONS))
    results, _ = await cluster.answers(settle_s=0)
    assert {r.scheduling.executors[-1] for r in results} == {"exec-a", "exec-b"}
