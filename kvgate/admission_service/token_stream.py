"""Token chunks out the moment the engine makes them, outside the commit cycles.

```
engine ─▶ Outbox.token ─▶ TokenStream.put ─▶ (next loop turn) producer.send, linger 0 ─▶ Kafka
                                                    └─ refused or failed ─▶ Outbox: the next
                                                       commit cycle sends it again (as it did
                                                       every chunk before)
```

What exactly-once means for a stream: a chunk belongs to a request that is still running, and a
request whose offset is not committed runs again, from its first token, wherever its partition
goes next. So no chunk can be exactly-once — a transaction never made one so, it only held the
chunk back until the cycle that also committed other requests' offsets. Chunks are therefore
sent at once, on one plain producer (no transactions, ``acks=all``, no idempotence: its
brokers need not support it), and are **at-least-once and idempotent by (request_id, index)**:
a consumer keeps the first chunk of each index and drops the rest. The result stays
exactly-once (with transactions) and is the truth: its tokens and text are whole even when a
chunk was lost or a re-run after a hand-off streamed different tokens than the first run.

Crash matrix of one chunk::

    crash before the send   the chunk is lost with the process; the request runs again on the
                            partition's next owner, which streams every chunk from index 0
    crash after the send    the chunk stays; the re-run writes it again (same id and index)
    the send fails          the chunk joins the outbox's next commit cycle and is retried there
                            while the partition is here (dropped with it on revocation: the
                            next owner streams it again)

Chunks of one request are sent in the order they were made; a retried one can arrive after its
successors, so a consumer orders by index (the gateway does).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from kvgate.admission_service.out_records import OutRecord
from kvgate.admission_service.replies import ReplyRoutes

log = logging.getLogger(__name__)

OnFailed = Callable[[int, OutRecord, BaseException], None]


class TokenStream:
    """Sends what ``put`` queues on the next turn of the event loop; ``run`` until
    ``stop_soon``, then what is queued is still handed to the producer."""

    def __init__(self, routes: ReplyRoutes, on_failed: OnFailed) -> None:
        self._routes = routes
        self._on_failed = on_failed
        self._queue: deque[tuple[int, OutRecord]] = deque()  # (request partition, record)
        self._wake = asyncio.Event()
        self._stopping = False
        self._producer: AIOKafkaProducer | None = None
        self.sent = 0  # chunks handed to the producer (acknowledged or not)

    def attach(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    def put(self, partition: int, records: list[OutRecord]) -> None:
        self._queue.extend((partition, r) for r in records)
        self._wake.set()

    def stop_soon(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._send_queued()
            if self._stopping and not self._queue:
                return

    async def _send_queued(self) -> None:
        producer = self._producer
        assert producer is not None, "attach a producer before run"
        while self._queue:
            partition, record = self._queue.popleft()
            if record.reply and not await self._routes.routable(
                producer, record.topic, record.partition or 0
            ):
                continue  # counted and logged by the routes; the chunk is nobody's to read
            try:
                future = await producer.send(
                    record.topic, record.value, key=record.key, partition=record.partition,
                    headers=record.headers,
                )  # fmt: skip
            except KafkaError as exc:  # refused before it was queued (its size, a closed client)
                self._on_failed(partition, record, exc)
                continue
            self.sent += 1
            future.add_done_callback(partial(self._acknowledged, partition, record))

    def _acknowledged(
        self, partition: int, record: OutRecord, future: asyncio.Future[RecordMetadata]
    ) -> None:
        if future.cancelled():
            self._on_failed(partition, record, asyncio.CancelledError())
            return
        error = future.exception()
        if error is not None:
            self._on_failed(partition, record, error)
