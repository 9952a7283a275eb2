"""The batch feeder: one owner per batch across every process that feeds, with failover.

**Ownership is partition assignment.** Feeders are members of one consumer group
(``feeder_group``) over ``kvgate.batches``; a batch's records all go to one partition
(``journal.partition_of``), so the member assigned that partition owns the batch. Kafka's group
protocol gives each partition to one member at a time and moves it when a member leaves or
stops heartbeating: that is the failover, with no lease of our own to get wrong. A member
that lost its partition without noticing (its session expired while it kept running) is fenced
by the claim epochs (``journal``): it sees the new owner's claim on the partition it still reads
and stops; readers ignore what it wrote after that claim.

Per owned partition p (:class:`PartitionOwner`)::

    assigned ─▶ read p from its start to the end it had at assignment (the fold: BatchTable)
             ─▶ claim p (epoch + 1) ─▶ reader of reply partition p, from the least
                results_from of its unfinished batches ─▶ one BatchRun per unfinished batch
    then:       a new batch (its creation record) ─▶ a run; a cancel ─▶ run.cancel();
                a stale record of a batch it runs ─▶ its state written again;
                a newer claim ─▶ lost: stop
    revoked ─▶  runs cancelled (their lines stay in Kafka: the next owner resumes them)

A run that fails (the store or Kafka refusing for longer than their clients retry) restarts the
whole partition after a backoff, exactly as a new owner would take it: one recovery path.

The group consumer never commits: every assignment reads the compacted partition from its start
(the latest record of each key: small), so there is no offset to lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.backoff import jittered_delay_s
from kvgate.batch.ids import parse_line_request_id
from kvgate.batch.journal import (
    Applied,
    BatchRecord,
    BatchTable,
    CancelRecord,
    ClaimRecord,
    FileRecord,
    batch_key,
    claim_key,
    encode,
    parse_journal,
)
from kvgate.batch.lines import LineMapper
from kvgate.batch.run import BatchRun
from kvgate.batch.settings import BatchSettings
from kvgate.batch.store import ObjectStore
from kvgate.batch.topics import ensure_batch_topics
from kvgate.gateway.settings import ModelRoute
from kvgate.kafka_connection import KafkaConnection, client_options
from kvgate.protocol.records import (
    REPLY_KIND_RESULT,
    AbortRequest,
    InferenceRequest,
    InferenceResult,
    ReplyTo,
    reply_kind,
)

log = logging.getLogger(__name__)

_RESTART_INITIAL_S = 1.0
_RESTART_MAX_S = 60.0


class ReplyReader:
    """Reads reply partition p (read_committed: never an aborted transaction's answer) from a
    start offset, and hands every result to the run of its batch."""

    def __init__(
        self, owner: PartitionOwner, options: dict[str, Any], start_offset: int | None
    ) -> None:
        self._owner = owner
        self._options = options
        self._start = start_offset
        self._tp = TopicPartition(owner.feeder.settings.reply_topic, owner.partition)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self.position = 0
        self._caught_up_at = 0
        self.caught_up = asyncio.Event()

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(
            **self._options, group_id=None, enable_auto_commit=False,
            isolation_level="read_committed",
            fetch_max_wait_ms=self._owner.feeder.settings.fetch_max_wait_ms,
        )  # fmt: skip
        self._consumer = consumer
        await consumer.start()
        consumer.assign([self._tp])
        self._caught_up_at = (await consumer.end_offsets([self._tp]))[self._tp]
        if self._start is None:
            await consumer.seek_to_end(self._tp)
        else:
            consumer.seek(self._tp, self._start)
        self.position = await consumer.position(self._tp)
        self._check_caught_up()
        self._task = asyncio.create_task(self._read(), name=f"batch-replies-{self._tp.partition}")

    def _check_caught_up(self) -> None:
        if self.position >= self._caught_up_at:
            self.caught_up.set()

    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            batch = await consumer.getmany(self._tp, timeout_ms=500)
            for message in batch.get(self._tp, ()):
                self.position = message.offset + 1
                kind = reply_kind(message.headers)
                if message.value is None or kind != REPLY_KIND_RESULT:
                    continue
                try:
                    result = InferenceResult.model_validate_json(message.value)
                except ValidationError:
                    log.warning("an unreadable reply at %s/%d", self._tp, message.offset)
                    continue
                self._owner.on_result(result, message.offset)
            self.position = await consumer.position(self._tp)  # past transaction markers
            self._check_caught_up()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


class _State(Enum):
    CATCHING_UP = "catching up"  # reading the partition to where it ended at assignment
    OWNING = "owning"
    STOPPED = "stopped"


class PartitionOwner:
    """Batch partition p while this member owns it (the module docstring)."""

    def __init__(self, feeder: BatchFeeder, partition: int, catch_up_to: int) -> None:
        self.feeder = feeder
        self.partition = partition
        self.catch_up_to = catch_up_to
        self.table = BatchTable()
        self.state = _State.CATCHING_UP
        self.epoch = 0
        self.reader: ReplyReader | None = None
        self.runs: dict[str, BatchRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._control: asyncio.Task[None] | None = None
        self._failures = 0

    # ------------------------------------------------------------------ records in
    def on_record(self, record: BatchRecord | CancelRecord | ClaimRecord) -> None:
        applied = self.table.apply(self.partition, record)
        if self.state is not _State.OWNING:
            return
        if isinstance(record, ClaimRecord):
            if applied is Applied.TAKEN and record.epoch > self.epoch:
                log.warning(
                    "batch partition %d was claimed by %s (epoch %d > %d): stopping its batches",
                    self.partition, record.owner, record.epoch, self.epoch,
                )  # fmt: skip
                self._spawn(self.stop())
        elif isinstance(record, CancelRecord):
            run = self.runs.get(record.batch_id)
            if run is not None:
                run.cancel()
        elif applied is Applied.TAKEN and record.epoch == 0:
            self._start_run(record)
        elif applied is Applied.STALE and record.id in self.runs:
            self._spawn(self.feeder.publish(self.partition, self.runs[record.id].record))

    def on_result(self, result: InferenceResult, offset: int) -> None:
        parsed = parse_line_request_id(result.request_id)
        if parsed is None:
            return
        run = self.runs.get(parsed[0])
        if run is not None:
            run.on_answer(parsed[1], result, offset)

    # ------------------------------------------------------------------ taking, losing
    def take_over(self) -> None:
        self.state = _State.OWNING
        self._control = asyncio.create_task(self._take_over(), name=f"batch-take-{self.partition}")

    async def _take_over(self) -> None:
        self.epoch = self.table.epoch(self.partition) + 1
        claim = await self.feeder.claim(self.partition, self.epoch)
        self.table.apply(self.partition, claim)  # durable: the table need not wait for its echo
        unfinished = [b for b in self.table.batches.values() if not b.status.terminal]
        starts = [
            b.checkpoint.results_from for b in unfinished if b.checkpoint.results_from is not None
        ]
        self.reader = ReplyReader(self, self.feeder.options, min(starts, default=None))
        await self.reader.start()
        log.info(
            "batch partition %d taken (epoch %d): %d unfinished batches",
            self.partition, self.epoch, len(unfinished),
        )  # fmt: skip
        for record in unfinished:
            self._start_run(record)

    def _start_run(self, record: BatchRecord) -> None:
        if record.id in self.runs or record.status.terminal:
            return
        run = BatchRun(
            record, epoch=self.epoch, ports=_Ports(self),
            mapper=self.feeder.mapper(record, self.partition), settings=self.feeder.settings,
        )  # fmt: skip
        if record.id in self.table.cancels:
            run.cancel()
        self.runs[record.id] = run
        self._tasks[record.id] = asyncio.create_task(
            self._supervise(run), name=f"batch-{record.id}"
        )

    async def _supervise(self, run: BatchRun) -> None:
        try:
            record = await run.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s failed here: its partition is taken again", run.record.id)
            self._spawn(self._restart())
            return
        log.info("batch %s is %s", record.id, record.status.value)
        self._failures = 0
        self.runs.pop(record.id, None)
        self._tasks.pop(record.id, None)

    async def _restart(self) -> None:
        """Stop everything here, wait, and take the partition again (a new claim)."""
        delay_s = jittered_delay_s(
            self._failures, initial_s=_RESTART_INITIAL_S, max_s=_RESTART_MAX_S
        )
        self._failures += 1
        await self._stop_work()
        await asyncio.sleep(delay_s)
        if self.state is _State.OWNING:
            await self._take_over()

    async def stop(self) -> None:
        """Revoked (or lost): stop the runs and the reader; nothing is aborted."""
        self.state = _State.STOPPED
        if self._control is not None and self._control is not asyncio.current_task():
            self._control.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._control
        await self._stop_work()

    async def _stop_work(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self.runs.clear()
        if self.reader is not None:
            await self.reader.stop()
            self.reader = None

    def _spawn(self, work: Any) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self.feeder.background.add(task)
        task.add_done_callback(self.feeder.background.discard)


class _Ports:
    """A run's ports (``run.RunPorts``) on its owner's partition."""

    def __init__(self, owner: PartitionOwner) -> None:
        self._owner = owner
        self._feeder = owner.feeder

    @property
    def store(self) -> ObjectStore:
        return self._feeder.store

    async def send(self, route: ModelRoute, request: InferenceRequest) -> None:
        await self._feeder.send(route, request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._feeder.abort(request_ids)

    async def publish(self, record: BatchRecord) -> None:
        await self._feeder.publish(self._owner.partition, record)
        # Durable now: a restart of the partition resumes from it even before its echo is read.
        self._owner.table.apply(self._owner.partition, record)

    async def add_file(self, record: FileRecord) -> None:
        await self._feeder.add_file(record)

    def reply_position(self) -> int:
        reader = self._owner.reader
        assert reader is not None  # runs start after the reader
        return reader.position

    async def replies_caught_up(self) -> None:
        reader = self._owner.reader
        assert reader is not None
        await reader.caught_up.wait()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, feeder: BatchFeeder) -> None:
        self._feeder = feeder

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._feeder.revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._feeder.assigned({tp.partition for tp in assigned})


class BatchFeeder:
    """Feeds the batches of the partitions this member is assigned (the module docstring)."""

    def __init__(
        self,
        *,
        kafka: KafkaConnection,
        settings: BatchSettings,
        routes: Sequence[ModelRoute],
        codecs: Mapping[str, TextCodec | None],
        abort_topic: str,
        default_max_tokens: int,
        store: ObjectStore,
    ) -> None:
        self.kafka = kafka
        self.settings = settings
        self.routes = {route.name: route for route in routes}
        self.codecs = codecs
        self.abort_topic = abort_topic
        self.default_max_tokens = default_max_tokens
        self.store = store
        self.options: dict[str, Any] = {}
        self.owners: dict[int, PartitionOwner] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.failure: BaseException | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self.member = kafka.client_id

    def mapper(self, record: BatchRecord, partition: int) -> LineMapper:
        """How the lines of ``record`` (on ``partition``) are read and answered."""
        reply = ReplyTo(topic=self.settings.reply_topic, partition=partition)
        return LineMapper(
            record, routes=self.routes, codecs=self.codecs,
            default_max_tokens=self.default_max_tokens, reply=reply,
        )  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.options = client_options(self.kafka)
        await ensure_batch_topics(self.options, self.settings)
        self._producer = AIOKafkaProducer(
            **self.options, acks="all", enable_idempotence=False, linger_ms=0
        )
        await self._producer.start()
        settings = self.settings
        self._consumer = AIOKafkaConsumer(
            **self.options, group_id=settings.feeder_group, enable_auto_commit=False,
            auto_offset_reset="earliest", session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=settings.heartbeat_interval_ms,
            fetch_max_wait_ms=settings.fetch_max_wait_ms,
        )  # fmt: skip
        await self._consumer.start()
        self._consumer.subscribe([settings.batches_topic], listener=_Rebalance(self))
        self._task = asyncio.create_task(self._consume(), name="batch-feeder")

    async def close(self) -> None:
        """Stop feeding: runs are cancelled (their lines stay in Kafka), the group is left so
        another member takes the partitions at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await self._task
        await self.revoked(set(self.owners))
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def assigned(self, partitions: set[int]) -> None:
        consumer = self._consumer
        assert consumer is not None
        tps = [TopicPartition(self.settings.batches_topic, p) for p in sorted(partitions)]
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            self.owners[tp.partition] = PartitionOwner(self, tp.partition, ends[tp])
        await consumer.seek_to_beginning(*tps)  # the compacted partition, whole
        log.info("batch partitions assigned: %s", sorted(partitions))

    async def revoked(self, partitions: set[int]) -> None:
        owners = [self.owners.pop(p) for p in sorted(partitions) if p in self.owners]
        await asyncio.gather(*(owner.stop() for owner in owners))
        if owners:
            log.info("batch partitions given up: %s", sorted(partitions))

    async def _consume(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=500)
                for tp, messages in batch.items():
                    owner = self.owners.get(tp.partition)
                    if owner is None:
                        continue  # revoked while this batch was fetched
                    for message in messages:
                        record = self._parse(message.value)
                        if record is not None:
                            owner.on_record(record)
                await self._take_caught_up(consumer)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("the batch feeder stopped")
            self.failure = exc
            raise

    @staticmethod
    def _parse(value: bytes | None) -> BatchRecord | CancelRecord | ClaimRecord | None:
        if value is None:
            return None
        try:
            return parse_journal(value)
        except ValidationError as exc:
            log.warning("an unreadable batch record: %s", exc.errors()[0]["msg"])
            return None

    async def _take_caught_up(self, consumer: AIOKafkaConsumer) -> None:
        for partition, owner in list(self.owners.items()):
            if owner.state is not _State.CATCHING_UP:
                continue
            tp = TopicPartition(self.settings.batches_topic, partition)
            if await consumer.position(tp) >= owner.catch_up_to:
                owner.take_over()

    # ------------------------------------------------------------------ writes
    async def claim(self, partition: int, epoch: int) -> ClaimRecord:
        record = ClaimRecord(partition=partition, epoch=epoch, owner=self.member)
        await self._send(
            self.settings.batches_topic, encode(record), claim_key(partition), partition
        )
        return record

    async def publish(self, partition: int, record: BatchRecord) -> None:
        key = batch_key(record.id)
        await self._send(self.settings.batches_topic, encode(record), key, partition)

    async def add_file(self, record: FileRecord) -> None:
        await self._send(self.settings.files_topic, encode(record), record.id.encode(), None)

    async def send(self, route: ModelRoute, request: InferenceRequest) -> None:
        value = request.model_dump_json(exclude_none=True).encode()
        await self._send(route.request_topic, value, request.request_id.encode(), None)

    async def abort(self, request_ids: Sequence[str]) -> None:
        producer = self._producer
        assert producer is not None
        sent = [
            await producer.send(
                self.abort_topic,
                AbortRequest(request_id=request_id).model_dump_json().encode(),
                key=request_id.encode(),
            )
            for request_id in request_ids
        ]
        await asyncio.gather(*sent)

    async def _send(self, topic: str, value: bytes, key: bytes, partition: int | None) -> None:
        producer = self._producer
        assert producer is not None
        await producer.send_and_wait(topic, value, key=key, partition=partition)
