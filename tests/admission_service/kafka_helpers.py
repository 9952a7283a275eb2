"""Kafka-side helpers for the service tests: topic names, producing requests, reading results
and dead letters, committed offsets. Used against the embedded broker here and against real
Kafka in tests/integration."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from kvgate.protocol.records import (
    TOKEN_KINDS,
    DeadLetter,
    InferenceResult,
    TokenChunk,
    reply_kind,
    token_chunks_of,
)


@dataclass(frozen=True)
class Topics:
    requests: str
    results: str
    aborts: str
    dlq: str
    tokens: str
    group: str

    @classmethod
    def unique(cls, label: str) -> Topics:
        base = f"t{uuid.uuid4().hex[:8]}-{label}"[:60]
        return cls(
            requests=f"{base}.requests",
            results=f"{base}.results",
            aborts=f"{base}.aborts",
            dlq=f"{base}.dlq",
            tokens=f"{base}.tokens",
            group=f"{base}-group",
        )

    def kafka_settings(self, bootstrap: str, **extra: Any) -> dict[str, Any]:
        return {
            "bootstrap_servers": bootstrap,
            "request_topic": self.requests,
            "result_topic": self.results,
            "abort_topic": self.aborts,
            "dlq_topic": self.dlq,
            "group_id": self.group,
            **extra,
        }


async def produce(
    bootstrap: str,
    topic: str,
    values: Iterable[dict[str, Any] | bytes | tuple[bytes, bytes]],
    *,
    headers: list[tuple[str, bytes]] | None = None,
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        futures = []
        for value in values:
            if isinstance(value, dict):
                key = str(value.get("request_id", "")).encode() or None
                data = json.dumps(value).encode()
            elif isinstance(value, tuple):
                key, data = value  # raw bytes under a key
            else:
                key, data = None, value
            futures.append(await producer.send(topic, data, key=key, headers=headers))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read_all(
    bootstrap: str,
    topic: str,
    *,
    until_count: int,
    timeout_s: float = 60.0,
    read_committed: bool = True,
    settle_s: float = 0.0,
    items: Callable[[Any], list[Any]] | None = None,
) -> list[Any]:
    """Every record of ``topic`` from the start (or what ``items`` makes of each), once
    ``until_count`` are there (plus ``settle_s`` more of reading, to catch duplicates that
    would arrive late)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_committed" if read_committed else "read_uncommitted",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[Any] = []
    try:
        partitions = None
        deadline = time.monotonic() + timeout_s
        while partitions is None:
            partitions = consumer.partitions_for_topic(topic)
            if partitions is None:
                await consumer._client.force_metadata_update()
                if time.monotonic() > deadline:
                    raise AssertionError(f"topic {topic} never appeared")
                await asyncio.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        settle_until: float | None = None
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                for message in messages:
                    records.extend([message] if items is None else items(message))
            now = time.monotonic()
            if len(records) >= until_count and settle_until is None:
                settle_until = now + settle_s
            if settle_until is not None and now >= settle_until:
                return records
            if now > deadline:
                raise AssertionError(
                    f"{topic}: {len(records)} records after {timeout_s:.0f} s, wanted {until_count}"
                )
    finally:
        await consumer.stop()


async def read_token_chunks(
    bootstrap: str,
    topic: str,
    *,
    until_count: int,
    request_id: str | None = None,
    read_committed: bool = False,
    **options: Any,
) -> list[tuple[int, TokenChunk]]:
    """The token chunks on ``topic`` (a token topic or a reply topic: its results are left
    out), with the partition each came on, from records of a step's chunks or of one chunk
    each; ``request_id``'s only when given."""

    def chunks_of(record: Any) -> list[tuple[int, TokenChunk]]:
        kind = reply_kind(record.headers)
        if kind is not None and kind not in TOKEN_KINDS:
            return []
        return [
            (record.partition, chunk)
            for chunk in token_chunks_of(kind, record.value)
            if request_id is None or chunk.request_id == request_id
        ]

    return await read_all(
        bootstrap, topic, until_count=until_count, read_committed=read_committed,
        items=chunks_of, **options,
    )  # fmt: skip


async def read_results(
    bootstrap: str, topic: str, count: int, **options: Any
) -> list[InferenceResult]:
    records = await read_all(bootstrap, topic, until_count=count, **options)
    return [InferenceResult.model_validate_json(r.value) for r in records]


async def read_dead_letters(bootstrap: str, topic: str, count: int) -> list[tuple[Any, DeadLetter]]:
    records = await read_all(bootstrap, topic, until_count=count)
    return [(r, DeadLetter.from_headers(list(r.headers))) for r in records]


async def committed_offsets(
    bootstrap: str, group: str, topic: str, partitions: int
) -> dict[int, int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        out = {}
        for p in range(partitions):
            offset = await consumer.committed(TopicPartition(topic, p))
            out[p] = -1 if offset is None else offset
        return out
    finally:
        await consumer.stop()


async def partition_ends(bootstrap: str, topic: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
        count = len(described[0]["partitions"])
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(count)]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: offset for tp, offset in ends.items()}
    finally:
        await consumer.stop()
