"""The batch topics, created when missing and checked when present.

``kvgate.batches`` and ``kvgate.files`` are compacted (the latest record of every key is kept
for good: the state survives any restart); the batch reply topic deletes by time
(``reply_retention_ms``, longer than a batch may run) and has as many partitions as
``kvgate.batches``: the owner of batch partition p reads reply partition p. A topic that exists
with another partition count is refused at start: ownership and replies would not line up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvgate.batch.settings import BatchSettings

log = logging.getLogger(__name__)

_ALREADY_EXISTS: Final = 36
_COMPACTED: Final = {"cleanup.policy": "compact"}


class BatchTopicError(RuntimeError):
    """The batch topics cannot be used as they are."""


async def ensure_batch_topics(options: dict[str, Any], settings: BatchSettings) -> None:
    wanted = {
        settings.batches_topic: (settings.partitions, _COMPACTED),
        settings.files_topic: (1, _COMPACTED),
        settings.reply_topic: (
            settings.partitions,
            {"retention.ms": str(settings.reply_retention_ms)},
        ),
    }
    admin = AIOKafkaAdminClient(**options)
    await admin.start()
    try:
        counts = await _partition_counts(admin, list(wanted))
        for topic, (partitions, config) in wanted.items():
            if topic not in counts:
                await _create(admin, topic, partitions, settings.replication_factor, config)
        counts = await _wait_for(admin, list(wanted))
        for topic in (settings.batches_topic, settings.reply_topic):
            if counts[topic] != settings.partitions:
                raise BatchTopicError(
                    f"{topic} has {counts[topic]} partitions, the batch settings say "
                    f"{settings.partitions}: the batch topic and the batch reply topic need the "
                    "same count (set batches partitions to it)"
                )
    finally:
        await admin.close()


async def _partition_counts(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    existing = set(await admin.list_topics())
    present = [t for t in topics if t in existing]
    if not present:
        return {}
    return {d["topic"]: len(d["partitions"]) for d in await admin.describe_topics(present)}


async def _create(
    admin: AIOKafkaAdminClient, topic: str, partitions: int, replicas: int, config: dict[str, str]
) -> None:
    response = await admin.create_topics(
        [NewTopic(topic, partitions, replicas, topic_configs=config)]
    )
    for _, code, *_ in response.topic_errors:
        if code not in (0, _ALREADY_EXISTS):
            what = f"{topic} ({partitions} partitions, {config})"
            raise BatchTopicError(f"creating {what} failed: error code {code}")
    log.info("created topic %s with %d partitions %s", topic, partitions, config)


async def _wait_for(
    admin: AIOKafkaAdminClient, topics: list[str], timeout_s: float = 30.0
) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await _partition_counts(admin, topics)
        if all(t in counts for t in topics):
            return counts
        if time.monotonic() > deadline:
            raise BatchTopicError(f"topics {topics} did not appear within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
