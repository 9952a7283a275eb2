"""Scenario 1: the admission service is killed (SIGKILL) mid-workload and restarted.

Two ``kvgate executor`` processes serve a tiny looped checkpoint; the service is killed once a
few answers are committed (with many requests still running on the executors), and a new one
takes over the same consumer group. Every request must be answered exactly once, with the
outputs of the unpaged reference on the same checkpoint: answers of the killed instance's open
transactions are aborted, its committed ones are not run again, everything else runs again.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.reliability.cluster import Cluster
from tests.reliability.traffic import read_answers
from tests.reliability.workloads import mixed_bodies, model_reference

pytestmark = pytest.mark.timeout(420, func_only=True)

EXECUTOR = {"num_blocks": 64, "block_size": 4, "host_snapshot_blocks": 24}


@pytest.mark.parametrize(
    ("requests", "kills"),
    [(40, 1), pytest.param(160, 3, marks=pytest.mark.slow, id="full")],
)
async def test_killed_service_loses_nothing_and_answers_once(
    cluster: Cluster, looped_model: Path, requests: int, kills: int
) -> None:
    bodies = mixed_bodies(requests, "k", vocab_size=128, num_loops=3, max_tokens=(12, 40))
    reference = await asyncio.to_thread(model_reference, looped_model, bodies)
    executors = cluster.real_executors("exec-a", "exec-b", model_dir=looped_model, **EXECUTOR)
    settings = cluster.settings(executors, kafka={"partitions": 4})
    service = cluster.service("service-0", settings)
    await cluster.send_requests(bodies)
    for kill in range(kills):
        # Kill once some answers are committed, with most requests still in flight.
        target = (kill + 1) * requests // (3 * kills)
        await read_answers(cluster.bootstrap, cluster.topics.results, target, settle_s=0)
        in_flight = await asyncio.to_thread(service.metric, "kvgate_admission_requests_in_flight")
        assert in_flight > 0, "the kill must fall mid-workload"
        service.process.signal(signal.SIGKILL)
        assert await asyncio.to_thread(service.process.wait, 30) == -signal.SIGKILL
        service = cluster.service(f"service-{kill + 1}", settings)
    summary = await cluster.verify(reference, [service], executors)
    assert summary.completed == requests
