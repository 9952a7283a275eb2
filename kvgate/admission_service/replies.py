"""Copies of answers to a gateway's own reply address (``InferenceRequest.reply``).

The results topic stays the source of truth: a reply copy is written in the same commit cycle
(the same transaction when exactly-once is on) and never decides whether a request offset is
final. A reply address the producer cannot route to (its topic does not exist, or has no such
partition) is skipped, counted and logged once per topic: a bad address costs its sender the
copy and never stalls the partition that carries the request.

Crash matrix: a crash before the cycle's acks loses the copy with the result (the request runs
again and both are written again); a retried send may write a copy twice at-least-once, so a
reader of replies keeps the first copy per request id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from kvgate.protocol.records import REPLY_KIND_HEADER

log = logging.getLogger(__name__)

_LOOKUP_TIMEOUT_S: Final = 2.0
_UNKNOWN_TOPIC_RETRY_S: Final = 30.0  # how long a topic found missing stays skipped


def reply_headers(kind: bytes) -> list[tuple[str, bytes]]:
    return [(REPLY_KIND_HEADER, kind)]


class ReplyRoutes:
    """Which reply addresses the producer can write to, from its metadata (cached by aiokafka;
    a topic it does not know is looked up once, with a short timeout, then skipped a while)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._missing_until: dict[str, float] = {}
        self.skipped = 0

    async def routable(self, producer: AIOKafkaProducer, topic: str, partition: int) -> bool:
        partitions = producer.client.cluster.partitions_for_topic(topic)
        if partitions is None and self._clock() >= self._missing_until.get(topic, 0.0):
            try:
                partitions = await asyncio.wait_for(
                    producer.partitions_for(topic), _LOOKUP_TIMEOUT_S
                )
            except (KafkaError, TimeoutError):
                partitions = None
            if partitions is None:
                self._missing_until[topic] = self._clock() + _UNKNOWN_TOPIC_RETRY_S
                log.warning("reply topic %s is unknown; skipping replies to it for now", topic)
        if partitions is not None and partition in partitions:
            return True
        self.skipped += 1
        return False
