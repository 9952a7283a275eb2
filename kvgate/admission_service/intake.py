"""Intake: the consumer group on the request topic, rebalances, backpressure, and aborts.

When it commits: never itself — offsets are committed by the outbox's commit cycles, only up to
the lowest offset still in flight, so a crash at any point re-delivers every request whose
answer is not durable (at-least-once consumption).

On assignment the rebalance callback only pauses the partitions it was given and starts
taking them over in a task (``takeover.py``: aiokafka does not heartbeat while the callback
runs, and taking a partition over costs up to a second): ``p``'s producer started (fencing the
previous owner), its ledger built from the committed offset and a scan of results partition
``p``, the position sought; then ``p`` alone is resumed. Reading a request found answered by
that scan finalises it without running it.

On revocation of ``p``: take-overs still running finish first; then requests read from ``p``
are cancelled here without answers (handed off), one last commit cycle commits ``p`` up to its
lowest unanswered offset, and ``p``'s producer stops — the next owner starts exactly where this
one stopped answering.

When ``p``'s producer is fenced while ``p`` is still assigned here (the outbox drops ``p``):
its requests are handed off, ``p`` stops being fetched, and the group is asked to rebalance.
Whoever gets ``p`` then — this instance included — takes it over as above. Without the
rebalance a fence that no new owner caused (a transaction the broker timed out) would leave
``p`` assigned here and never read again.

Text prompts are tokenized on worker threads (``limits.tokenizer_threads``), never on the event
loop, after the character limit is checked; while one is tokenized its offset is in flight like
any running request's.

Backpressure: all request partitions are paused while the requests waiting here (read, not yet
running) reach ``limits.max_waiting_requests``, or the texts waiting for tokenization reach
``limits.max_pending_tokenizations``, and resumed once they fall to their resume marks.
Records already fetched when the pause starts are still queued, so the mark can be overshot by
up to ``max_poll_records``.

Aborts are read by every instance (no consumer group, from the end of the topic at start): the
request being aborted may be on any of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord

from kvgate.admission_service.engine import Engine
from kvgate.admission_service.executor_tokenizer import PoolTokenizer
from kvgate.admission_service.kafka_io import raw_record
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.offsets import PartitionLedger
from kvgate.admission_service.outbox import Outbox
from kvgate.admission_service.settings import ServiceSettings
from kvgate.admission_service.takeover import TakeOvers
from kvgate.admission_service.tokenizer import TextCodec, TokenizerThreads
from kvgate.admission_service.validation import (
    Accepted,
    NeedsTokens,
    RawRecord,
    Rejection,
    check_request,
    tokenized,
    validate_abort,
)
from kvgate.kafka_connection import client_options
from kvgate.protocol.records import RejectCode

log = logging.getLogger(__name__)

_POLL_MS = 100


def request_consumer(settings: ServiceSettings) -> AIOKafkaConsumer:
    kafka = settings.kafka
    return AIOKafkaConsumer(
        **client_options(kafka),
        group_id=kafka.group_id,
        enable_auto_commit=False,
        auto_offset_reset=kafka.auto_offset_reset.value,
        isolation_level=kafka.isolation_level.value,
        session_timeout_ms=kafka.session_timeout_ms,
        heartbeat_interval_ms=kafka.heartbeat_interval_ms,
        max_poll_interval_ms=kafka.max_poll_interval_ms,
        max_poll_records=kafka.max_poll_records,
        # A request is read the moment it is there (interactive latency): the broker answers
        # as soon as it has one byte, and holds an empty fetch at most fetch_max_wait_ms.
        fetch_min_bytes=1,
        fetch_max_wait_ms=kafka.fetch_max_wait_ms,
        fetch_max_bytes=max(52428800, 2 * settings.limits.max_message_bytes),
        max_partition_fetch_bytes=max(1048576, settings.limits.max_message_bytes + 1024),
    )


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, intake: Intake) -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._intake.revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._intake.assigned(assigned)


class Intake:
    def __init__(
        self,
        settings: ServiceSettings,
        consumer: AIOKafkaConsumer,
        *,
        engine: Engine,
        outbox: Outbox,
        metrics: ServiceMetrics,
        tokenizer: TextCodec | None,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self._on_failure = on_failure
        self.consumer = consumer
        self.engine = engine
        self.outbox = outbox
        self.metrics = metrics
        self._tokenizer = (
            None
            if tokenizer is None
            else TokenizerThreads(tokenizer, settings.limits.tokenizer_threads)
        )
        # The pool's tokenizer, when it comes from the executors: texts wait until it is known.
        self._pool_tokenizer = tokenizer if isinstance(tokenizer, PoolTokenizer) else None
        self._tokenizing: set[asyncio.Task[None]] = set()
        self.paused = False
        self._take_overs = TakeOvers(
            settings,
            consumer,
            outbox,
            engine.answered,
            on_ready=self._taken_over,
            on_failure=on_failure,
        )
        # The assigned partitions that are taken over and not fenced: the only ones resumed.
        self._readable: set[TopicPartition] = set()
        self._fetching = True
        self._stopped = asyncio.Event()
        self._positions: dict[int, int] = {}  # partition -> next offset to read
        self._first_read: dict[int, int] = {}  # partition -> first offset read since assignment

    @property
    def assigned_once(self) -> asyncio.Event:
        """Set once the first assignment has been taken over whole."""
        return self._take_overs.taken_over_once

    def subscribe(self) -> None:
        self.consumer.subscribe([self.settings.kafka.request_topic], listener=_Rebalance(self))

    # ------------------------------------------------------------------------ rebalances
    async def revoked(self, revoked: set[TopicPartition]) -> None:
        await self._take_overs.settle()
        self._readable -= revoked
        for tp in sorted(revoked):
            handed_off = self.engine.drop_partition(tp.topic, tp.partition)
            await self.outbox.close_partition(tp.partition)
            log.info("partition %d revoked (%d requests handed off)", tp.partition, handed_off)

    def fenced(self, partition: int) -> None:
        """``partition``'s producer was fenced while it is assigned here (see the module
        docstring): hand its requests off and let the group decide who owns it."""
        tp = TopicPartition(self.settings.kafka.request_topic, partition)
        handed_off = self.engine.drop_partition(tp.topic, tp.partition)
        self._readable.discard(tp)
        if tp in self.consumer.assignment():
            self.consumer.pause(tp)
        log.warning(
            "partition %d fenced (%d requests handed off): asking the group to rebalance",
            partition,
            handed_off,
        )
        # aiokafka has no public call for this; its coordinator rejoins (revoking and
        # reassigning every partition) at once.
        coordinator = getattr(self.consumer, "_coordinator", None)
        if coordinator is not None:
            coordinator.request_rejoin()

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        # Returns at once: no heartbeat is sent until it does (see takeover.py). Nothing may
        # be read from a partition before its ledger exists, and the consumer starts fetching
        # as soon as the assignment is set.
        self.consumer.pause(*assigned)
        self._take_overs.start(assigned)

    def _taken_over(self, tp: TopicPartition) -> None:
        """``tp`` has its ledger and position: read it (unless intake is paused or stopping)."""
        self._first_read.pop(tp.partition, None)
        self._readable.add(tp)
        if self._fetching and not self.paused:
            self.consumer.resume(tp)

    # ---------------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Read, validate and queue requests until ``stop_fetching``."""
        try:
            while self._fetching:
                batch = await self.consumer.getmany(timeout_ms=_POLL_MS)
                if not self._fetching:
                    break  # shutting down: what was fetched is read again by the next owner
                for tp, messages in batch.items():
                    self._take(tp.partition, messages)
                self._backpressure()
        finally:
            self._stopped.set()

    def _take(self, partition: int, messages: list[ConsumerRecord[bytes, bytes]]) -> None:
        engine = self.engine
        outbox = self.outbox
        limits = self.settings.limits
        self.metrics.received.inc(len(messages))
        if messages:
            self._positions[partition] = messages[-1].offset + 1
            self._first_read.setdefault(partition, messages[0].offset)
        for message in messages:
            record = raw_record(message)
            if outbox.read(partition, record.offset):
                continue  # answered before (by a previous owner), or not ours (fenced)
            verdict = check_request(record, limits, has_tokenizer=self._tokenizer is not None)
            if isinstance(verdict, Accepted):
                engine.submit(record, verdict)
            elif isinstance(verdict, NeedsTokens):
                self._tokenize(record, verdict)
            else:
                engine.reject(record, verdict)

    def _tokenize(self, record: RawRecord, pending: NeedsTokens) -> None:
        """Tokenize off the loop; the request continues from there unless its partition left
        this instance meanwhile (then its next owner reads it again)."""
        ledger = self.outbox.ledgers.get(record.partition)
        task = asyncio.create_task(self._tokenized(record, pending, ledger))
        self._tokenizing.add(task)
        task.add_done_callback(self._tokenizing.discard)

    async def _tokenized(
        self, record: RawRecord, pending: NeedsTokens, ledger: PartitionLedger | None
    ) -> None:
        assert self._tokenizer is not None
        try:
            limits = self.settings.limits
            if self._pool_tokenizer is not None:
                await self._pool_tokenizer.known(limits.tokenizer_wait_s)
            verdict = await self._tokenizer.call(lambda codec: tokenized(pending, codec, limits))
        except Exception as exc:  # a tokenizer error is about this prompt, never fatal
            verdict = Rejection(
                RejectCode.SCHEMA,
                f"the prompt text cannot be tokenized: {exc}",
                pending.request.request_id,
                pending.request.reply,
            )
        if self.outbox.ledgers.get(record.partition) is not ledger:
            return  # revoked or fenced while it was tokenized: handed off
        if isinstance(verdict, Accepted):
            self.engine.submit(record, verdict)
        else:
            self.engine.reject(record, verdict)

    def _backpressure(self) -> None:
        waiting = self.engine.num_waiting
        limits = self.settings.limits
        texts = len(self._tokenizing)
        if not self.paused and (
            waiting >= limits.max_waiting_requests or texts >= limits.max_pending_tokenizations
        ):
            self.paused = True
            self.consumer.pause(*self.consumer.assignment())
            log.info("pausing intake: %d requests waiting", waiting)
        elif (
            self.paused
            and waiting <= limits.resume_mark
            and texts < limits.max_pending_tokenizations // 2 + 1
        ):
            self.paused = False
            self.consumer.resume(*(self._readable & self.consumer.assignment()))
            log.info("resuming intake: %d requests waiting", waiting)

    async def stop_fetching(self) -> None:
        """Stop reading new requests (shutdown); returns once the loop has stopped."""
        self._fetching = False
        self.consumer.pause(*self.consumer.assignment())
        await self._stopped.wait()
        # Texts being tokenized become requests (or rejections) before the grace period; texts
        # still waiting for the pool's tokenizer stay unanswered (the next owner reads them).
        if self._pool_tokenizer is not None and self._pool_tokenizer.digest is None:
            for task in self._tokenizing:
                task.cancel()
        await asyncio.gather(*self._tokenizing, return_exceptions=True)
        if self._tokenizer is not None:
            self._tokenizer.close()

    def lag(self) -> dict[int, int]:
        """Records of each assigned partition not yet committed: from the committed offset
        (before the first commit, the first offset read) to the end as of the last fetch. Work
        read but not durably answered counts, so a partition whose commits fail shows."""
        lags = {}
        for tp in self.consumer.assignment():
            end = self.consumer.highwater(tp)
            ledger = self.outbox.ledgers.get(tp.partition)
            committed = None if ledger is None else ledger.committed
            if committed is None:
                committed = self._first_read.get(tp.partition, self._positions.get(tp.partition))
            if end is not None and committed is not None:
                lags[tp.partition] = max(0, end - committed)
        return lags


class AbortReader:
    """Every abort, on every instance: a group-less consumer from the topic's end at start."""

    def __init__(self, settings: ServiceSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.consumer = AIOKafkaConsumer(
            **client_options(settings.kafka),
            group_id=None,
            enable_auto_commit=False,
            isolation_level=settings.kafka.isolation_level.value,
        )

    async def start(self) -> None:
        topic = self.settings.kafka.abort_topic
        await self.consumer.start()
        partitions = self.consumer.partitions_for_topic(topic)
        if not partitions:
            partitions = await self._wait_partitions(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:
            await self.consumer.position(tp)  # resolve "end" now, not at the first fetch

    async def _wait_partitions(self, topic: str) -> set[int]:
        for _ in range(100):
            await self.consumer._client.force_metadata_update()
            partitions = self.consumer.partitions_for_topic(topic)
            if partitions:
                return set(partitions)
            await asyncio.sleep(0.1)
        raise KafkaError(f"topic {topic} has no partitions")

    async def run(self) -> None:
        max_bytes = self.settings.limits.max_message_bytes
        while True:
            batch = await self.consumer.getmany(timeout_ms=500)
            for messages in batch.values():
                for message in messages:
                    verdict = validate_abort(raw_record(message), max_bytes)
                    if isinstance(verdict, Rejection):
                        log.warning(
                            "ignoring a bad abort at %s/%d: %s",
                            message.partition,
                            message.offset,
                            verdict.reason,
                        )
                        continue
                    self.engine.abort(verdict.request_id)

    async def stop(self) -> None:
        await self.consumer.stop()
