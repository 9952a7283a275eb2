"""The batch topics, created when missing and checked when present.

``kvgate.batches`` and ``kvgate.files`` are compacted (the latest record of every key is kept
for good: the state survives any restart); the batch reply topic deletes by time
(``reply_retention_ms``, longer than a batch may run) and has as many partitions as
``kvgate.batches``: the owner of batch partition p reads reply partition p. A topic that exists
with another partition count is refused at start: ownership and replies would not line up.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvgate.batch.settings import BatchSettings
from kvgate.kafka_connection import partition_counts, wait_for_topics

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
        counts = await partition_counts(admin, list(wanted))
        for topic, (partitions, config) in wanted.items():
            if topic not in counts:
                await _create(admin, topic, partitions, settings.replication_factor, config)
        appeared = await wait_for_topics(admin, list(wanted))
        if appeared is None:
            raise BatchTopicError(f"topics {sorted(wanted)} did not appear within 30 s")
        counts = appeared
        for topic in (settings.batches_topic, settings.reply_topic):
            if counts[topic] != settings.partitions:
                raise BatchTopicError(
                    f"{topic} has {counts[topic]} partitions, the batch settings say "
                    f"{settings.partitions}: the batch topic and the batch reply topic need the "
                    "same count (set batches partitions to it)"
                )
    finally:
        await admin.close()


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
