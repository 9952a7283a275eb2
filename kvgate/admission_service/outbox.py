"""Delivery: answers, dead letters and token chunks out; consumed offsets committed.

Commit cycles run every ``commit_interval_ms`` (sooner when much is pending). Per request
partition ``p`` one cycle does:

exactly-once (transactions; one producer per request partition, transactional id
``<prefix>.<request topic>.<p>``)::

    begin → send p's results / dead letters / tokens → send_offsets(p's commit point)
          → commit        (nothing is visible to read_committed consumers before this)

    crash before commit   the transaction is aborted (at the latest when the partition's next
                          owner starts a producer with the same transactional id, which fences
                          this one); the requests run again there; no answer is seen twice
    crash after commit    answers and offsets are both durable; nothing runs again

at-least-once (``exactly_once`` off, e.g. on Tansu; one idempotence-free producer)::

    send p's records, wait for acks=all → commit the consumer offset (with metadata)

    crash before the acks  nothing of the cycle counted; the requests run again elsewhere
    crash between          answers are durable but the offset is not: the next owner finds
                           them by the results scan and skips the requests — unless the scan
                           could not see them (a broker that keeps no commit metadata or has
                           wrong end offsets) or a retried send was written twice; then a
                           duplicate answer is possible
    crash after commit     nothing runs again

In both modes the commit point is the lowest offset still in flight (``offsets.py``); the
metadata records where in the results partition answers above it begin.

A fenced producer (``ProducerFenced``) means this instance may no longer own the partition: a
newer owner started a producer with its transactional id, or the broker aborted a transaction
that outlived ``transaction_timeout_ms`` and bumped the producer's epoch — and in that second
case no rebalance follows. The partition is dropped here (its cycle's answers are discarded,
their offsets stay uncommitted) and ``on_fenced`` is told, so that intake hands its requests
off and asks the group to rebalance; the group's answer decides who takes the partition over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import OffsetAndMetadata, RecordMetadata

from kvgate.admission_service.faults import BEFORE_COMMIT, CrashPoints
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.offsets import CommitPoint, PartitionLedger
from kvgate.admission_service.settings import KafkaSettings
from kvgate.admission_service.validation import RawRecord, Rejection
from kvgate.protocol.records import (
    TRACEPARENT_HEADER,
    DeadLetter,
    InferenceResult,
    SourceRef,
    TokenChunk,
)

log = logging.getLogger(__name__)

_FLUSH_SOON_RECORDS = 1000
CommitOffsets = Callable[[dict[TopicPartition, OffsetAndMetadata]], Awaitable[None]]
ProducerFactory = Callable[[str | None], AIOKafkaProducer]


def _ignore_fencing(partition: int) -> None:
    """The default ``on_fenced``: nothing else to tell."""


@dataclass(frozen=True, slots=True)
class OutRecord:
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


@dataclass(slots=True)
class _Pending:
    records: list[OutRecord] = field(default_factory=list)
    finals: list[tuple[int, int | None]] = field(default_factory=list)  # (offset, record index)

    def __bool__(self) -> bool:
        return bool(self.records or self.finals)


class Outbox:
    """Implements the engine's ``OutcomeSink``; owns the partition ledgers and the producers."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        transactional: bool,
        producer_factory: ProducerFactory,
        commit_offsets: CommitOffsets,
        metrics: ServiceMetrics,
        crash_points: CrashPoints | None = None,
        on_fenced: Callable[[int], None] = _ignore_fencing,
    ) -> None:
        self.settings = settings
        self.transactional = transactional
        self._on_fenced = on_fenced
        self._crash = crash_points or CrashPoints({})
        self._new_producer = producer_factory
        self._commit_offsets = commit_offsets
        self.metrics = metrics
        self.ledgers: dict[int, PartitionLedger] = {}
        self._pending: dict[int, _Pending] = {}
        self._producers: dict[int, AIOKafkaProducer] = {}  # per partition (transactional)
        self._shared: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._soon = asyncio.Event()
        self._stopping = False
        self._num_pending = 0

    # ----------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if not self.transactional:
            self._shared = self._new_producer(None)
            await self._shared.start()

    async def close(self) -> None:
        async with self._lock:
            for partition in list(self._producers):
                await self._stop_producer(partition)
            if self._shared is not None:
                await self._shared.stop()
                self._shared = None

    async def open_partition(self, partition: int) -> None:
        """Before reading ``partition``: with transactions, start its producer — which fences
        the previous owner's and completes or aborts its open transaction."""
        if self.transactional and partition not in self._producers:
            producer = self._new_producer(self._transactional_id(partition))
            await producer.start()
            self._producers[partition] = producer

    def track(self, partition: int, ledger: PartitionLedger) -> None:
        self.ledgers[partition] = ledger

    async def close_partition(self, partition: int) -> None:
        """On revocation: one last commit cycle for it, then forget it."""
        async with self._lock:
            if partition in self.ledgers:
                await self._cycle(partition)
            self.ledgers.pop(partition, None)
            self._drop_pending(partition)
            await self._stop_producer(partition)

    def _transactional_id(self, partition: int) -> str:
        return f"{self.settings.transactional_prefix}.{self.settings.request_topic}.{partition}"

    async def _stop_producer(self, partition: int) -> None:
        producer = self._producers.pop(partition, None)
        if producer is not None:
            with contextlib.suppress(KafkaError):
                await producer.stop()

    # ------------------------------------------------------------------ outcome sink
    def read(self, partition: int, offset: int) -> bool:
        """Note a request read; True when it is already answered (skip it: it is final)."""
        ledger = self.ledgers.get(partition)
        if ledger is None:
            return True  # not ours (revoked or fenced): never run it
        return ledger.read(offset) is not None

    def answer(self, result: InferenceResult, traceparent: str | None) -> None:
        headers = [] if traceparent is None else [(TRACEPARENT_HEADER, traceparent.encode())]
        record = OutRecord(
            self.settings.result_topic,
            result.source.partition,
            result.request_id.encode(),
            result.model_dump_json(exclude_none=True).encode(),
            headers,
        )
        self._add(result.source, [record], result_index=0)

    def reject(
        self, record: RawRecord, rejection: Rejection, result: InferenceResult | None
    ) -> None:
        letter = DeadLetter(
            code=rejection.code,
            reason=rejection.reason,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp_ms,
        )
        out = [
            OutRecord(
                self.settings.dlq_topic,
                None,
                record.key,
                record.value,
                [*record.headers, *letter.headers()],
            )
        ]
        if result is not None:
            out.append(
                OutRecord(
                    self.settings.result_topic,
                    record.partition,
                    result.request_id.encode(),
                    result.model_dump_json(exclude_none=True).encode(),
                    [],
                )
            )
        self.metrics.dead_letters.inc()
        source = SourceRef(topic=record.topic, partition=record.partition, offset=record.offset)
        self._add(source, out, result_index=1 if result is not None else None)

    def token(self, source: SourceRef, chunk: TokenChunk) -> None:
        topic = self.settings.token_topic
        if topic is None or source.partition not in self.ledgers:
            return
        record = OutRecord(
            topic, source.partition, chunk.request_id.encode(), chunk.model_dump_json().encode(), []
        )
        self._pending.setdefault(source.partition, _Pending()).records.append(record)
        self._count(1)

    def _add(self, source: SourceRef, records: list[OutRecord], result_index: int | None) -> None:
        if source.partition not in self.ledgers:
            log.debug("dropping an answer for revoked partition %d", source.partition)
            return
        pending = self._pending.setdefault(source.partition, _Pending())
        base = len(pending.records)
        pending.records.extend(records)
        index = None if result_index is None else base + result_index
        pending.finals.append((source.offset, index))
        self._count(len(records))

    def _count(self, records: int) -> None:
        self._num_pending += records
        if self._num_pending >= _FLUSH_SOON_RECORDS:
            self._soon.set()

    def _drop_pending(self, partition: int) -> None:
        dropped = self._pending.pop(partition, None)
        if dropped is not None:
            self._num_pending -= len(dropped.records)

    # ------------------------------------------------------------------- commit cycles
    async def run(self) -> None:
        """Commit cycles until ``stop_soon``; the cycle under way always completes."""
        interval_s = self.settings.commit_interval_ms / 1000
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), interval_s)
            self._soon.clear()
            await self.flush()

    def stop_soon(self) -> None:
        """End ``run`` after the current cycle (shutdown then runs the last ones itself)."""
        self._stopping = True
        self._soon.set()

    async def flush(self) -> None:
        async with self._lock:
            partitions = list(self.ledgers)
            if self.transactional:
                await asyncio.gather(*(self._cycle(p) for p in partitions))
            else:
                await self._plain_cycle(partitions)

    async def _cycle(self, partition: int) -> None:
        if self.transactional:
            await self._transaction(partition)
        else:
            await self._plain_cycle([partition])

    async def _send(
        self, producer: AIOKafkaProducer, records: list[OutRecord]
    ) -> list[RecordMetadata]:
        futures = [
            await producer.send(
                r.topic, r.value, key=r.key, partition=r.partition, headers=r.headers
            )
            for r in records
        ]
        # Every outcome is collected (a failed batch fails many futures; none may go unread).
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)

    @staticmethod
    def _finals(pending: _Pending, sent: list[RecordMetadata]) -> dict[int, int | None]:
        return {
            offset: (None if index is None else int(sent[index].offset))
            for offset, index in pending.finals
        }

    async def _transaction(self, partition: int) -> None:
        ledger = self.ledgers.get(partition)
        producer = self._producers.get(partition)
        if ledger is None or producer is None:
            return
        pending = self._pending.pop(partition, _Pending())
        if not pending and ledger.commit_point() is None:
            return
        began = False
        try:
            await producer.begin_transaction()
            began = True
            sent = await self._send(producer, pending.records)
            finals = self._finals(pending, sent)
            point = ledger.commit_point(finals)
            if point is not None:
                tp = TopicPartition(self.settings.request_topic, partition)
                await producer.send_offsets_to_transaction(
                    {tp: (point.offset, point.metadata)}, self.settings.group_id
                )
            if pending.finals:
                self._crash.reached(BEFORE_COMMIT)
            await producer.commit_transaction()
        except ProducerFenced:
            log.error(
                "partition %d: its producer was fenced (a newer owner, or a transaction that "
                "outlived transaction_timeout_ms); dropping the partition",
                partition,
            )
            self.metrics.commits.labels(outcome="fenced").inc()
            self.ledgers.pop(partition, None)
            self._num_pending -= len(pending.records)
            await self._stop_producer(partition)
            self._on_fenced(partition)
            return
        except KafkaError as exc:
            log.warning("partition %d: transaction failed (%r); retrying", partition, exc)
            self.metrics.commits.labels(outcome="failed").inc()
            with contextlib.suppress(KafkaError):
                await producer.abort_transaction()
            self._restore(partition, pending)
            return
        except BaseException:
            # Cancelled (or a bug) mid-transaction: leave no transaction open behind us, and
            # keep what it carried for the next cycle.
            if began:
                with contextlib.suppress(Exception):
                    await asyncio.shield(producer.abort_transaction())
            self._restore(partition, pending)
            raise
        self._num_pending -= len(pending.records)
        ledger.finalize(finals)
        if point is not None:
            ledger.committed_at(point)
        self.metrics.commits.labels(outcome="committed").inc()

    async def _plain_cycle(self, partitions: list[int]) -> None:
        producer = self._shared
        assert producer is not None
        taken = {p: self._pending.pop(p, _Pending()) for p in partitions if p in self.ledgers}
        records = [r for pending in taken.values() for r in pending.records]
        try:
            sent = await self._send(producer, records)
        except KafkaError as exc:
            log.warning("sending answers failed (%r); retrying", exc)
            self.metrics.commits.labels(outcome="failed").inc()
            for partition, pending in taken.items():
                self._restore(partition, pending)
            return
        self._num_pending -= len(records)
        points: dict[int, CommitPoint] = {}
        start = 0
        for partition, pending in taken.items():
            chunk = sent[start : start + len(pending.records)]
            start += len(pending.records)
            ledger = self.ledgers.get(partition)
            if ledger is None:
                continue
            ledger.finalize(self._finals(pending, chunk))
            point = ledger.commit_point()
            if point is not None:
                points[partition] = point
        if not points:
            return
        if any(pending.finals for pending in taken.values()):
            self._crash.reached(BEFORE_COMMIT)
        offsets = {
            TopicPartition(self.settings.request_topic, p): OffsetAndMetadata(
                point.offset, point.metadata
            )
            for p, point in points.items()
        }
        try:
            await self._commit_offsets(offsets)
        except KafkaError as exc:
            log.warning("committing offsets failed (%r); the next cycle retries", exc)
            self.metrics.commits.labels(outcome="failed").inc()
            return
        for partition, point in points.items():
            ledger = self.ledgers.get(partition)
            if ledger is not None:
                ledger.committed_at(point)
        self.metrics.commits.labels(outcome="committed").inc()

    def _restore(self, partition: int, pending: _Pending) -> None:
        """Put back what a failed cycle took (before anything newer for the partition)."""
        if partition not in self.ledgers:
            self._num_pending -= len(pending.records)
            return
        newer = self._pending.get(partition)
        if newer is not None:
            pending.finals.extend(
                (o, None if i is None else i + len(pending.records)) for o, i in newer.finals
            )
            pending.records.extend(newer.records)
        self._pending[partition] = pending
