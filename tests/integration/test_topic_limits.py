"""Topic size limits against real Kafka (which, unlike the embedded broker, enforces them).

A requests topic that accepts larger records than the dead-letter topic once let an oversized
request's dead letter be refused by the broker forever, stopping its partition. Now the service
reads both topics' ``max.message.bytes`` at start-up, creates a missing dead-letter topic with
the request topic's limit (so the original fits and is kept whole), and truncates a dead letter
only when an existing dead-letter topic is smaller; either way every record after it is served.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer

from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import load_settings
from kvgate.protocol.records import DeadLetter, RejectCode
from kvgate.sim.backend import LocalConnector, SimExecutorConfig
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, read_all, read_results
from tests.harness.kafka import KafkaBroker
from tests.harness.kafka_client import create_topic_async

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180, func_only=True)]
LARGE_TOPIC = 8 << 20
HUGE = b"x" * (6 << 20)  # over the service's default 1 MiB limit and 4 MiB producer request


@pytest.fixture
async def connector() -> AsyncIterator[LocalConnector]:
    local = LocalConnector()
    local.add("a", SimExecutorConfig(num_blocks=64, block_size=4))
    yield local


async def _serve_one_huge_record(
    kafka_broker: KafkaBroker, connector: LocalConnector, topics: Topics
) -> tuple[DeadLetter, bytes]:
    bootstrap = kafka_broker.bootstrap
    await create_topic_async(
        bootstrap, topics.requests, configs={"max.message.bytes": str(LARGE_TOPIC)}
    )
    settings = load_settings(
        None,
        {
            "kafka": topics.kafka_settings(bootstrap, partitions=1, commit_interval_ms=50),
            "executors": {"members": [{"name": "a", "endpoint": "ws://local/a"}]},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
    )
    service = AdmissionService(settings, connector=connector)
    await service.start()
    try:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=LARGE_TOPIC)
        await producer.start()
        try:
            for key, value in [
                (b"huge-1", HUGE),
                (b"ok-1", json.dumps(request_body("ok-1", max_tokens=2)).encode()),
            ]:
                await (await producer.send(topics.requests, value, key=key))
        finally:
            await producer.stop()
        results = await read_results(bootstrap, topics.results, 2, settle_s=1.0)
        assert Counter(r.request_id for r in results) == {"huge-1": 1, "ok-1": 1}
        (letter,) = await read_all(bootstrap, topics.dlq, until_count=1, settle_s=1.0)
        return DeadLetter.from_headers(letter.headers), letter.value
    finally:
        assert await service.shutdown() == 0


async def test_a_created_dead_letter_topic_matches_the_request_topic(
    kafka_broker: KafkaBroker, connector: LocalConnector
) -> None:
    meta, value = await _serve_one_huge_record(kafka_broker, connector, Topics.unique("match"))
    assert meta.code is RejectCode.TOO_LARGE and not meta.truncated
    assert value == HUGE, "the original bytes, whole"


async def test_a_smaller_existing_dead_letter_topic_gets_a_truncated_copy(
    kafka_broker: KafkaBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("smaller")
    await create_topic_async(kafka_broker.bootstrap, topics.dlq)  # the broker's 1 MiB default
    meta, value = await _serve_one_huge_record(kafka_broker, connector, topics)
    assert meta.truncated and meta.original_bytes == len(HUGE)
    assert meta.sha256 == hashlib.sha256(HUGE).hexdigest()
    assert (meta.topic, meta.partition, meta.offset) == (topics.requests, 0, 0)
    assert HUGE.startswith(value) and 0 < len(value) < 1 << 20
