"""Smoke tests of the real-Kafka harness: the broker does what the service's tests rely on.

Each test checks one property that kvgate's reliability model needs from Kafka (and that the
embedded Tansu broker lacks): transactions with read_committed isolation, exact end offsets,
group offsets that survive a consumer and a broker restart, and faults that tests can inject.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import ConsumerRecord

from tests.harness.kafka import ContainerKafka, KafkaBroker
from tests.harness.kafka_client import TopicFactory, run_async

# `docker` is added by the conftest unless KAFKA_BOOTSTRAP names an external broker.
pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180, func_only=True)]

UniqueName = Callable[[str], str]


def _consumer(broker: KafkaBroker, topic: str, **settings: object) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **settings,
    )


async def _read(
    consumer: AIOKafkaConsumer, count: int, timeout_s: float = 30.0
) -> list[ConsumerRecord[bytes, bytes]]:
    """Exactly ``count`` records, or fail naming how many arrived before the deadline."""
    records: list[ConsumerRecord[bytes, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=500, max_records=count - len(records))
        for partition_records in batches.values():
            records.extend(partition_records)
    assert len(records) == count, f"read {len(records)} of {count} records in {timeout_s} s"
    return records


def _values(records: list[ConsumerRecord[bytes, bytes]]) -> list[bytes]:
    return [record.value for record in records if record.value is not None]


async def test_idempotent_producer_batch_has_exact_end_offset(
    kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        # Not awaited one by one: the records travel as multi-record batches.
        sends = [await producer.send(kafka_topic, f"r{i}".encode()) for i in range(20)]
        offsets = [meta.offset for meta in await asyncio.gather(*sends)]
    finally:
        await producer.stop()
    assert offsets == list(range(20))

    consumer = _consumer(kafka_broker, kafka_topic)
    await consumer.start()
    try:
        partition = TopicPartition(kafka_topic, 0)
        assert await consumer.end_offsets([partition]) == {partition: 20}
        assert _values(await _read(consumer, 20)) == [f"r{i}".encode() for i in range(20)]
    finally:
        await consumer.stop()


async def test_read_committed_sees_committed_transactions_only(
    kafka_broker: KafkaBroker, kafka_topic: str, unique_name: UniqueName
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_broker.bootstrap, transactional_id=unique_name("txn")
    )
    await producer.start()
    try:
        for batch, commit in (([b"c1", b"c2"], True), ([b"a1", b"a2"], False), ([b"c3"], True)):
            await producer.begin_transaction()
            for value in batch:
                await producer.send_and_wait(kafka_topic, value)
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()

    committed = _consumer(kafka_broker, kafka_topic, isolation_level="read_committed")
    uncommitted = _consumer(kafka_broker, kafka_topic, isolation_level="read_uncommitted")
    await committed.start()
    await uncommitted.start()
    try:
        # The aborted records are in the log; only read_committed hides them.
        assert _values(await _read(uncommitted, 5)) == [b"c1", b"c2", b"a1", b"a2", b"c3"]
        assert _values(await _read(committed, 3)) == [b"c1", b"c2", b"c3"]
        # 5 records plus one control marker per transaction.
        partition = TopicPartition(kafka_topic, 0)
        assert await committed.end_offsets([partition]) == {partition: 8}
    finally:
        await committed.stop()
        await uncommitted.stop()


async def test_consumer_group_resumes_after_committed_offset(
    kafka_broker: KafkaBroker, kafka_topic: str, unique_name: UniqueName
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(6):
            await producer.send_and_wait(kafka_topic, f"m{i}".encode())
    finally:
        await producer.stop()

    group = unique_name("group")
    partition = TopicPartition(kafka_topic, 0)
    first = _consumer(kafka_broker, kafka_topic, group_id=group)
    await first.start()
    try:
        records = await _read(first, 4)
        # Commit only the first three: offset 3 is the next record to read.
        await first.commit({partition: records[2].offset + 1})
    finally:
        await first.stop()

    second = _consumer(kafka_broker, kafka_topic, group_id=group)
    await second.start()
    try:
        assert await second.committed(partition) == 3
        assert _values(await _read(second, 3)) == [b"m3", b"m4", b"m5"]
    finally:
        await second.stop()


async def test_paused_broker_times_out_and_recovers_on_unpause(
    controllable_kafka: ContainerKafka, kafka_topic: str
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=controllable_kafka.bootstrap, request_timeout_ms=2000, acks="all"
    )
    await producer.start()
    try:
        await producer.send_and_wait(kafka_topic, b"before")
        controllable_kafka.pause()
        with pytest.raises((KafkaError, TimeoutError)):
            await asyncio.wait_for(producer.send_and_wait(kafka_topic, b"during"), timeout=8)
        await asyncio.to_thread(controllable_kafka.unpause)
        after = await asyncio.wait_for(producer.send_and_wait(kafka_topic, b"after"), timeout=30)
    finally:
        await producer.stop()
    consumer = _consumer(controllable_kafka, kafka_topic)
    await consumer.start()
    try:
        values = _values(await _read(consumer, after.offset + 1))
    finally:
        await consumer.stop()
    assert values[0] == b"before"
    assert values[-1] == b"after"


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "sigkill"])
async def test_restart_keeps_records_offsets_and_address(
    controllable_kafka: ContainerKafka, kafka_topic: str, unique_name: UniqueName, hard: bool
) -> None:
    bootstrap = controllable_kafka.bootstrap
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(3):
            await producer.send_and_wait(kafka_topic, f"d{i}".encode())
    finally:
        await producer.stop()
    group = unique_name("group")
    partition = TopicPartition(kafka_topic, 0)
    consumer = _consumer(controllable_kafka, kafka_topic, group_id=group)
    await consumer.start()
    try:
        await _read(consumer, 1)
        await consumer.commit({partition: 1})
    finally:
        await consumer.stop()

    await asyncio.to_thread(controllable_kafka.restart, hard=hard)

    assert controllable_kafka.bootstrap == bootstrap
    resumed = _consumer(controllable_kafka, kafka_topic, group_id=group)
    await resumed.start()
    try:
        assert await resumed.committed(partition) == 1
        assert _values(await _read(resumed, 2)) == [b"d1", b"d2"]
    finally:
        await resumed.stop()


def test_topic_factory_creates_distinct_ready_topics(
    kafka_broker: KafkaBroker, topic_factory: TopicFactory
) -> None:
    async def leaders_of(topic: str) -> dict[int, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        await admin.start()
        try:
            (described,) = await admin.describe_topics([topic])
        finally:
            await admin.close()
        return {p["partition"]: p["leader"] for p in described["partitions"]}

    first = topic_factory(partitions=3)
    second = topic_factory(partitions=3)
    assert first != second
    # Ready means every partition already has a leader (the single broker, node 1).
    assert run_async(lambda: leaders_of(first)) == {0: 1, 1: 1, 2: 1}


async def test_tls_listener_serves_clients_that_verify_the_broker(
    kafka_broker: KafkaBroker, kafka_topic: str
) -> None:
    if kafka_broker.tls is None:
        pytest.skip("the broker has no TLS listener (KAFKA_BOOTSTRAP points at an external one)")
    endpoint = kafka_broker.tls
    producer = AIOKafkaProducer(
        bootstrap_servers=endpoint.bootstrap,
        security_protocol="SSL",
        ssl_context=create_ssl_context(cafile=str(endpoint.ca_file)),
    )
    await producer.start()
    try:
        sent = await producer.send_and_wait(kafka_topic, b"over tls")
    finally:
        await producer.stop()
    assert sent.offset == 0

    # A client that does not trust the session's certificate must not get through.
    untrusting = AIOKafkaProducer(
        bootstrap_servers=endpoint.bootstrap,
        security_protocol="SSL",
        ssl_context=create_ssl_context(),
        request_timeout_ms=3000,
    )
    with pytest.raises(KafkaError):
        await untrusting.start()
    await untrusting.stop()
