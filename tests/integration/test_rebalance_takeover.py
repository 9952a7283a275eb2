"""Taking partitions over never stops the heartbeat (real Kafka, exactly-once on).

aiokafka sends no heartbeat while the assignment callback runs. Taking a partition over on a
new exactly-once group costs about 0.63 s (its transactional producer's first InitProducerId,
the committed offset, the results scan); when the callback did it for every partition in turn,
16 partitions took 10 s, the 6 s session (the broker's smallest) expired, and every fresh
service was expelled from its group right after it started: its work was handed off and taken
back, and what was in flight ran twice. The take-over now runs off the callback (and its
partitions concurrently), so the member stays.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import load_settings
from kvgate.sim.backend import LocalConnector, SimExecutorConfig
from tests.admission_service.helpers import request_body, until
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.harness.kafka import KafkaBroker

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180, func_only=True)]
PARTITIONS = 16
# The broker's smallest session (group.min.session.timeout.ms): taken over one after another,
# 16 partitions outlive it.
SESSION_TIMEOUT_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000


@pytest.fixture
async def connector() -> AsyncIterator[LocalConnector]:
    local = LocalConnector()
    local.add("a", SimExecutorConfig(num_blocks=64, block_size=4))
    yield local


def revocations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvgate.admission_service.intake" and "revoked" in r.getMessage()
    ]


async def test_a_fresh_exactly_once_service_with_many_partitions_is_not_expelled(
    kafka_broker: KafkaBroker, connector: LocalConnector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.admission_service")
    bootstrap = kafka_broker.bootstrap
    topics = Topics.unique("takeover")
    settings = load_settings(
        None,
        {
            "kafka": topics.kafka_settings(
                bootstrap,
                partitions=PARTITIONS,
                exactly_once="on",
                session_timeout_ms=SESSION_TIMEOUT_MS,
                heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
                commit_interval_ms=50,
            ),
            "executors": {"members": [{"name": "a", "endpoint": "ws://local/a"}]},
            "admin": {"host": "127.0.0.1", "port": 0},
            "shutdown": {"grace_period_s": 0.0},
        },
    )
    service = AdmissionService(settings, connector=connector)
    await service.start()
    try:
        intake = service.intake
        assert intake is not None and service.outbox is not None
        assert service.outbox.transactional, "the test is about an exactly-once group"
        await until(intake.assigned_once.is_set, timeout_s=60.0, what="the partitions taken over")
        assert len(intake.consumer.assignment()) == PARTITIONS
        # An expelled member learns it at its first heartbeat after the session ran out and
        # revokes everything; watch a whole session (and two heartbeats) past the take-over.
        watch_until = time.monotonic() + (SESSION_TIMEOUT_MS + 2 * HEARTBEAT_INTERVAL_MS) / 1000
        while time.monotonic() < watch_until:
            assert not revocations(caplog), "expelled from the group after taking over"
            await asyncio.sleep(0.05)
        assert not revocations(caplog)
        assert len(intake.consumer.assignment()) == PARTITIONS
        # Every partition is read once taken over: requests keyed across all of them are
        # answered, each once.
        bodies = [request_body(f"to{i:02d}", max_tokens=4) for i in range(3 * PARTITIONS)]
        await produce(bootstrap, topics.requests, bodies)
        results = await read_results(bootstrap, topics.results, len(bodies), settle_s=1.0)
        assert Counter(r.request_id for r in results) == {b["request_id"]: 1 for b in bodies}
        assert not revocations(caplog)
    finally:
        assert await service.shutdown() == 0
