"""The gateway's view of every file and batch, and its writes to the batch topics.

Every gateway replica reads all of ``kvgate.batches`` and ``kvgate.files`` (no group, from their
start: compacted topics hold the latest record of each key) into one ``BatchTable`` and a file
map, so any replica answers GET for any file or batch. A replica's own writes are applied as soon
as they are durable (a client that creates and then retrieves on the same replica sees its
batch); a miss is answered only after :meth:`BatchBook.sync` has read up to the topics' ends as
they were when it was asked (a batch created through another replica is found).

Memory: one record per file and per batch (about a kilobyte each), for as long as the topics
keep them (docs/batch.md, "Limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from kvgate.batch.journal import (
    BatchRecord,
    BatchTable,
    CancelRecord,
    FileRecord,
    batch_key,
    cancel_key,
    encode,
    parse_file,
    parse_journal,
    partition_of,
)
from kvgate.batch.settings import BatchSettings
from kvgate.batch.topics import ensure_batch_topics

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 5.0


class BatchBook:
    def __init__(self, settings: BatchSettings) -> None:
        self._options: dict[str, Any] = {}
        self.settings = settings
        self.table = BatchTable()
        self.files: dict[str, FileRecord] = {}
        self.ready = asyncio.Event()
        self.failure: BaseException | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._tps: list[TopicPartition] = []
        self._progress = asyncio.Condition()

    async def start(self, options: dict[str, Any]) -> None:
        """Read the topics up to their current ends; ``options``: aiokafka's client options."""
        self._options = options
        await ensure_batch_topics(options, self.settings)
        self._producer = AIOKafkaProducer(
            **self._options, acks="all", enable_idempotence=False, linger_ms=0
        )
        await self._producer.start()
        consumer = AIOKafkaConsumer(
            **self._options, group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=self.settings.fetch_max_wait_ms,
        )  # fmt: skip
        self._consumer = consumer
        await consumer.start()
        self._tps = [
            TopicPartition(self.settings.batches_topic, p) for p in range(self.settings.partitions)
        ]
        self._tps.append(TopicPartition(self.settings.files_topic, 0))
        consumer.assign(self._tps)
        await consumer.seek_to_beginning(*self._tps)
        self._task = asyncio.create_task(self._read(), name="batch-book")
        await self.sync(timeout_s=60.0)
        self.ready.set()

    async def close(self) -> None:
        self.ready.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    # ------------------------------------------------------------------ reading
    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=500)
                for tp, messages in batch.items():
                    for message in messages:
                        self._apply(tp, message.key, message.value)
                async with self._progress:
                    self._progress.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("reading the batch topics failed")
            self.failure = exc
            self.ready.clear()
            raise

    def _apply(self, tp: TopicPartition, key: bytes | None, value: bytes | None) -> None:
        try:
            if tp.topic == self.settings.files_topic:
                if value is None:
                    if key is not None:
                        self.files.pop(key.decode(), None)
                    return
                record = parse_file(value)
                self.files[record.id] = record
            elif value is not None:
                self.table.apply(tp.partition, parse_journal(value))
        except (ValidationError, UnicodeDecodeError) as exc:
            log.warning("an unreadable record on %s/%d: %r", tp.topic, tp.partition, exc)

    async def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """Wait until everything written before the call is read (False: not within
        ``timeout_s``)."""
        consumer = self._consumer
        assert consumer is not None
        ends = await consumer.end_offsets(self._tps)
        deadline = time.monotonic() + timeout_s

        async def behind() -> bool:
            for tp, end in ends.items():
                if await consumer.position(tp) < end:
                    return True
            return False

        async with self._progress:
            while await behind():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._task is None or self._task.done():
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._progress.wait(), remaining)
        return True

    # ------------------------------------------------------------------ looking up
    def batch(self, batch_id: str) -> BatchRecord | None:
        return self.table.batches.get(batch_id)

    def cancel_of(self, batch_id: str) -> CancelRecord | None:
        return self.table.cancels.get(batch_id)

    def batches_of(self, owner: str) -> list[BatchRecord]:
        """``owner``'s batches, newest first."""
        mine = [b for b in self.table.batches.values() if b.owner == owner]
        return sorted(mine, key=lambda b: (b.created_at, b.id), reverse=True)

    def files_of(self, owner: str) -> list[FileRecord]:
        mine = [f for f in self.files.values() if f.owner == owner]
        return sorted(mine, key=lambda f: (f.created_at, f.id), reverse=True)

    # ------------------------------------------------------------------ writing
    async def add_file(self, record: FileRecord) -> None:
        await self._send(self.settings.files_topic, record.id.encode(), encode(record), 0)
        self.files[record.id] = record

    async def delete_file(self, file_id: str) -> None:
        await self._send(self.settings.files_topic, file_id.encode(), None, 0)
        self.files.pop(file_id, None)

    async def create_batch(self, record: BatchRecord) -> None:
        partition = partition_of(record.id, self.settings.partitions)
        key = batch_key(record.id)
        await self._send(self.settings.batches_topic, key, encode(record), partition)
        self.table.apply(partition, record)

    async def cancel_batch(self, record: CancelRecord) -> None:
        partition = partition_of(record.batch_id, self.settings.partitions)
        key = cancel_key(record.batch_id)
        await self._send(self.settings.batches_topic, key, encode(record), partition)
        self.table.apply(partition, record)

    async def _send(self, topic: str, key: bytes, value: bytes | None, partition: int) -> None:
        producer = self._producer
        assert producer is not None
        await producer.send_and_wait(topic, value, key=key, partition=partition)
