"""A partition's transactional producer fenced while the service still owns the partition.

Kafka fences a transactional producer when another one starts with the same transactional id
(the partition's next owner, after a rebalance) — and also when the broker aborts a
transaction that outlived ``transaction_timeout_ms`` (a long broker pause, a stalled commit).
In the second case no rebalance follows: the service keeps the partition. Its requests must
still be answered, exactly once.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer

from kvgate.sim.backend import SimExecutorConfig
from tests.reliability.cluster import Cluster
from tests.reliability.processes import parse_metrics
from tests.reliability.traffic import Message, read_answers
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(300, func_only=True)

GEOMETRY = {"num_blocks": 128, "block_size": 8}


async def test_fenced_partition_producer_without_rebalance_loses_nothing(cluster: Cluster) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    first = mixed_bodies(16, "f", vocab_size=512)
    later = mixed_bodies(16, "g", vocab_size=512)
    reference = sim_reference(first + later, config)
    executors = cluster.sim_executors("exec-a", step_time_ms=5, **GEOMETRY)
    service = cluster.service("service", cluster.settings(executors, kafka={"partitions": 2}))
    await cluster.send([Message.request(b, partition=i % 2) for i, b in enumerate(first)])
    await read_answers(cluster.bootstrap, cluster.topics.results, len(first), settle_s=0)

    # Another producer with partition 0's transactional id fences the service's producer, as a
    # broker aborting a timed-out transaction would: no rebalance follows.
    topics = cluster.topics
    fencer = AIOKafkaProducer(
        bootstrap_servers=cluster.bootstrap,
        transactional_id=f"{topics.group}.{topics.requests}.0",
    )
    await fencer.start()
    await fencer.stop()
    await cluster.send([Message.request(b, partition=i % 2) for i, b in enumerate(later)])
    summary = await cluster.verify(reference, [service], executors, timeout_s=90)
    assert summary.completed == len(first) + len(later)
    samples = parse_metrics(await asyncio.to_thread(service.metrics))
    assert samples['kvgate_admission_commits_total{outcome="fenced"}'] == 1
