"""Delivery: answers and dead letters out; consumed offsets committed; token chunks streamed.

Token chunks do not wait for a commit cycle: ``token`` hands them to the token stream
(``token_stream.py``: sent at once, at-least-once, idempotent by request id and index — why
that is all a chunk of a running request can be, and what a crash does, is said there). A
chunk whose send fails comes back here and goes out with the next cycle.

Commit cycles run every ``commit_interval_ms`` (sooner when much is pending), and at once when
an answer with a reply address is pending — someone waits for it; a cycle under way finishes
first, and the next one takes everything that came meanwhile, so under load cycles run back
to back and each carries more. A partition whose
cycle failed sits out the regular cycles for a jittered delay that doubles from
``commit_interval_ms`` up to ``COMMIT_RETRY_MAX_S`` (``kvgate/backoff.py``), so an outage is not
met with a retry storm; its answers wait, nothing is lost. Per request partition ``p`` one cycle
does:

exactly-once (transactions; one producer per request partition, transactional id
``<prefix>.<request topic>.<p>``)::

    begin → send p's results / dead letters (and retried token chunks)
          → send_offsets(p's commit point)
          → commit        (nothing is visible to read_committed consumers before this)

    crash before commit   the transaction is aborted (at the latest when the partition's next
                          owner starts a producer with the same transactional id, which fences
                          this one); the requests run again there; no answer is seen twice
    crash after commit    answers and offsets are both durable; nothing runs again

at-least-once (``exactly_once`` off, e.g. on Tansu; the idempotence-free producer the token
stream uses too)::

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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    ProducerFenced,
    RecordTooLargeError,
)
from aiokafka.structs import OffsetAndMetadata, RecordMetadata

from kvgate.admission_service.dead_letters import MIN_DEAD_LETTER_BYTES, dead_letter_copy
from kvgate.admission_service.faults import BEFORE_COMMIT, CrashPoints
from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.offsets import CommitPoint, PartitionLedger
from kvgate.admission_service.out_records import OutRecord, reply_record
from kvgate.admission_service.replies import ReplyRoutes
from kvgate.admission_service.settings import KafkaSettings
from kvgate.admission_service.token_stream import (
    StreamLane,
    StreamTarget,
    TokenStream,
)
from kvgate.admission_service.validation import RawRecord, Rejection
from kvgate.backoff import jittered_delay_s
from kvgate.protocol.records import (
    TRACEPARENT_HEADER,
    DeadLetter,
    InferenceResult,
    ReplyTo,
    SourceRef,
    TokenRecords,
)

log = logging.getLogger(__name__)

_FLUSH_SOON_RECORDS = 1000
# The longest a failing partition sits out regular commit cycles before trying again.
COMMIT_RETRY_MAX_S = 2.0
# Errors no retry can cure: the record itself is refused (by the producer or the broker).
_REFUSED_RECORD = (MessageSizeTooLargeError, RecordTooLargeError)
CommitOffsets = Callable[[dict[TopicPartition, OffsetAndMetadata]], Awaitable[None]]
ProducerFactory = Callable[[str | None], AIOKafkaProducer]


def _ignore_fencing(partition: int) -> None:
    """The default ``on_fenced``: nothing else to tell."""


def _skipped_future(record: OutRecord) -> asyncio.Future[RecordMetadata]:
    """The outcome of a reply copy that was not sent (unroutable): done, so that it neither
    holds its request's offset back nor is sent again."""
    future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
    tp = TopicPartition(record.topic, record.partition or 0)
    future.set_result(RecordMetadata(record.topic, tp.partition, tp, -1, -1, 0, 0))
    return future


@dataclass(slots=True)
class _Entry:
    """What one request offset (``offset``; None for a token chunk) still has to write."""

    offset: int | None
    records: list[OutRecord]
    result_topic: str
    results_offset: int | None = None  # where its result landed, once written

    def written(self, record: OutRecord, sent: RecordMetadata) -> None:
        self.records.remove(record)
        if record.topic == self.result_topic:
            self.results_offset = int(sent.offset)


@dataclass(slots=True)
class _Stall:
    """A partition whose commit cycles fail: since when, the last error, how many cycles in a
    row failed, and when the next regular cycle may try again."""

    since: float
    error: str
    failures: int = 1
    retry_at: float = 0.0


@dataclass(frozen=True, slots=True)
class StuckPartition:
    partition: int
    stalled_s: float
    unwritten: int  # answers made here and not yet durable
    error: str


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
        dead_letter_max_bytes: int = 1 << 20,
        answered: AnsweredIds | None = None,
        crash_points: CrashPoints | None = None,
        on_fenced: Callable[[int], None] = _ignore_fencing,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.transactional = transactional
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self._answered = answered
        self._on_fenced = on_fenced
        self._crash = crash_points or CrashPoints({})
        self._new_producer = producer_factory
        self._commit_offsets = commit_offsets
        self.metrics = metrics
        self._clock = clock
        self.ledgers: dict[int, PartitionLedger] = {}
        self._pending: dict[int, list[_Entry]] = {}
        self._stalls: dict[int, _Stall] = {}
        self._producers: dict[int, AIOKafkaProducer] = {}  # per partition (transactional)
        # Plain: the token stream's, and the cycles' too when there are no transactions.
        self._shared: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._soon = asyncio.Event()
        self._stopping = False
        self._num_pending = 0  # records
        self.reply_routes = ReplyRoutes()
        self.stream = TokenStream(
            self.reply_routes, self._token_failed,
            per_token=settings.token_records is TokenRecords.PER_TOKEN,
        )  # fmt: skip
        # Per request partition, and per (request partition, reply address) for requests whose
        # reply address takes tokens: the chunks' targets and what is queued for them.
        self._lanes: dict[int | tuple[int, str, int], StreamLane] = {}

    # ----------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._shared = self._new_producer(None)
        await self._shared.start()
        self.stream.attach(self._shared)

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

    async def close_partition(self, partition: int) -> int:
        """On revocation (and at shutdown): one last commit cycle for it, then forget it.
        Returns how many answers made here could not be written (their requests run again
        on the partition's next owner)."""
        async with self._lock:
            if partition in self.ledgers:
                await self._cycle(partition)
            self.ledgers.pop(partition, None)
            self._close_lanes(partition)
            unwritten = self._unwritten(partition)
            self._drop_pending(partition)
            self._stalls.pop(partition, None)
            await self._stop_producer(partition)
        if unwritten:
            log.error(
                "partition %d: %d answers could not be written; their requests will run again",
                partition,
                unwritten,
            )
        return unwritten

    def _transactional_id(self, partition: int) -> str:
        return f"{self.settings.transactional_prefix}.{self.settings.request_topic}.{partition}"

    async def _stop_producer(self, partition: int) -> None:
        producer = self._producers.pop(partition, None)
        if producer is not None:
            with contextlib.suppress(KafkaError):
                await producer.stop()

    # ------------------------------------------------------------------------- health
    def _unwritten(self, partition: int) -> int:
        return sum(1 for e in self._pending.get(partition, ()) if e.offset is not None)

    def unwritten_by_partition(self) -> dict[int, int]:
        return {p: self._unwritten(p) for p in self.ledgers}

    def stuck(self) -> list[StuckPartition]:
        """Partitions whose commit cycles have failed since some time (none while healthy)."""
        now = self._clock()
        return [
            StuckPartition(p, now - stall.since, self._unwritten(p), stall.error)
            for p, stall in sorted(self._stalls.items())
        ]

    def _failed(self, partitions: list[int], error: BaseException) -> None:
        self.metrics.commits.labels(outcome="failed").inc()
        now = self._clock()
        interval_s = self.settings.commit_interval_ms / 1000
        for partition in partitions:
            stall = self._stalls.get(partition)
            if stall is None:
                stall = self._stalls[partition] = _Stall(now, repr(error))
            else:
                stall.error = repr(error)
                stall.failures += 1
            stall.retry_at = now + jittered_delay_s(
                stall.failures - 1,
                initial_s=interval_s,
                max_s=max(interval_s, COMMIT_RETRY_MAX_S),
            )

    def _due(self, partition: int, now: float) -> bool:
        stall = self._stalls.get(partition)
        return stall is None or stall.retry_at <= now

    def _succeeded(self, partitions: list[int]) -> None:
        for partition in partitions:
            self._stalls.pop(partition, None)

    # ------------------------------------------------------------------ outcome sink
    def read(self, partition: int, offset: int) -> bool:
        """Note a request read; True when it is already answered (skip it: it is final)."""
        ledger = self.ledgers.get(partition)
        if ledger is None:
            return True  # not ours (revoked or fenced): never run it
        return ledger.read(offset) is not None

    def answer(
        self, result: InferenceResult, traceparent: str | None, reply: ReplyTo | None = None
    ) -> None:
        headers = [] if traceparent is None else [(TRACEPARENT_HEADER, traceparent.encode())]
        value = result.model_dump_json(exclude_none=True).encode()
        key = result.request_id.encode()
        records = [
            OutRecord(self.settings.result_topic, result.source.partition, key, value, headers)
        ]
        if reply is not None:
            records.append(reply_record(reply, key, value))
        self._add(result.source, records)

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
        out = [self._dead_letter(record.key, record.value, list(record.headers), letter)]
        if result is not None:
            key = result.request_id.encode()
            value = result.model_dump_json(exclude_none=True).encode()
            out.append(OutRecord(self.settings.result_topic, record.partition, key, value, []))
            if rejection.reply is not None:
                out.append(reply_record(rejection.reply, key, value))
        self.metrics.dead_letters.inc()
        source = SourceRef(topic=record.topic, partition=record.partition, offset=record.offset)
        self._add(source, out)

    def _dead_letter(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        letter: DeadLetter,
        max_bytes: int | None = None,
    ) -> OutRecord:
        copy = dead_letter_copy(
            key, value, headers, letter, max_bytes=max_bytes or self.dead_letter_max_bytes
        )
        if copy.truncated:
            self.metrics.truncated_dead_letters.inc()
            log.warning(
                "the dead letter of %s/%d/%d is truncated: the original has %d bytes",
                letter.topic,
                letter.partition,
                letter.offset,
                len(value or b""),
            )
        return OutRecord(
            self.settings.dlq_topic, None, copy.key, copy.value, copy.headers, copy.letter
        )

    def lane(self, source: SourceRef, reply: ReplyTo | None = None) -> StreamLane | None:
        """Where the chunks of a request read from ``source`` go, each ``put`` there streamed at
        once (``token_stream.py``), not with the next commit cycle. None: nowhere (its partition
        is not here, or no target takes them). A lane closes when its partition leaves."""
        partition = source.partition
        if partition not in self.ledgers:
            return None
        key: int | tuple[int, str, int] = partition
        if reply is not None and reply.tokens:
            key = (partition, reply.topic, reply.partition)
        lane = self._lanes.get(key)
        if lane is None:
            topic = self.settings.token_topic
            targets = (StreamTarget(topic, partition),) if topic is not None else ()
            if reply is not None and reply.tokens:
                targets = (*targets, StreamTarget(reply.topic, reply.partition, reply=True))
            if not targets:
                return None
            lane = self._lanes[key] = StreamLane(partition, targets)
        return lane

    def put(self, lane: StreamLane, chunk: str) -> None:
        """Stream ``chunk`` (``records.stream_json``'s text) to ``lane``'s targets."""
        self.stream.put(lane, chunk)

    def _close_lanes(self, partition: int) -> None:
        for key in [key for key, lane in self._lanes.items() if lane.partition == partition]:
            self._lanes.pop(key).open = False

    def _token_failed(self, partition: int, record: OutRecord, error: BaseException) -> None:
        """A chunk the stream could not write goes out with ``partition``'s next commit cycle
        (and is retried there), unless the partition has left: its next owner streams it."""
        if partition not in self.ledgers:
            return
        log.warning("token chunks were not streamed (%r); the next commit cycle sends them", error)
        entry = _Entry(None, [record], self.settings.result_topic)
        self._pending.setdefault(partition, []).append(entry)
        self._count(1)

    def _add(self, source: SourceRef, records: list[OutRecord]) -> None:
        entry = _Entry(source.offset, records, self.settings.result_topic)
        if source.partition not in self.ledgers:
            log.debug("dropping an answer for revoked partition %d", source.partition)
            self._discarded([entry])
            return
        self._pending.setdefault(source.partition, []).append(entry)
        self._count(len(records))
        if any(r.reply for r in records):
            self._soon.set()  # somebody waits for this answer: commit it now

    def _count(self, records: int) -> None:
        self._num_pending += records
        if self._num_pending >= _FLUSH_SOON_RECORDS:
            self._soon.set()

    def _drop_pending(self, partition: int) -> None:
        entries = self._pending.pop(partition, [])
        self._num_pending -= sum(len(e.records) for e in entries)
        self._discarded(entries)

    def _discarded(self, entries: list[_Entry]) -> None:
        """Answers dropped before they were durable: their requests run again (elsewhere or
        here), so their ids are not answered (see idempotency.py)."""
        if self._answered is None:
            return
        self._answered.forget(
            r.key.decode()
            for e in entries
            for r in e.records
            if r.topic == e.result_topic and r.key is not None
        )

    # ------------------------------------------------------------------- commit cycles
    async def run(self) -> None:
        """Commit cycles and the token stream until ``stop_soon``; the cycle under way always
        completes, and chunks already made are still handed to the producer."""
        streaming = asyncio.create_task(self.stream.run(), name="token-stream")
        interval_s = self.settings.commit_interval_ms / 1000
        try:
            while not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._soon.wait(), interval_s)
                self._soon.clear()
                await self.flush()
        finally:
            self.stream.stop_soon()
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await streaming

    def stop_soon(self) -> None:
        """End ``run`` after the current cycle (shutdown then runs the last ones itself)."""
        self._stopping = True
        self.stream.stop_soon()
        self._soon.set()

    async def flush(self) -> None:
        """One regular cycle over the partitions that are due: a partition whose cycles fail
        waits a jittered, doubling delay first (``_failed``); revocation and shutdown cycles
        (``close_partition``) always run."""
        async with self._lock:
            now = self._clock()
            partitions = [p for p in self.ledgers if self._due(p, now)]
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
    ) -> list[RecordMetadata | BaseException]:
        """Send every record; each one's outcome, in order (one refused record fails alone:
        the others are still sent, and nothing that was written is sent again)."""
        futures: list[asyncio.Future[RecordMetadata] | BaseException] = []
        for r in records:
            if r.reply and not await self.reply_routes.routable(
                producer, r.topic, r.partition or 0
            ):
                futures.append(_skipped_future(r))
                continue
            try:
                future = await producer.send(
                    r.topic, r.value, key=r.key, partition=r.partition, headers=r.headers
                )
            except KafkaError as exc:  # refused before it was queued (e.g. its size)
                futures.append(exc)
            else:
                futures.append(future)
        waiting = [f for f in futures if isinstance(f, asyncio.Future)]
        # Every outcome is collected (a failed batch fails many futures; none may go unread).
        await asyncio.gather(*waiting, return_exceptions=True)
        return [
            f if isinstance(f, BaseException) else (f.exception() or f.result()) for f in futures
        ]

    def _replace_refused(
        self, entries: list[_Entry], outcomes: dict[int, RecordMetadata | BaseException]
    ) -> None:
        """A dead letter the broker or producer refused (its topic allows less than measured
        at start-up) is replaced by its smallest form, so that the retry cannot fail the same
        way; any other refused record is retried as it is (and the partition shows as stuck)."""
        for entry in entries:
            for i, record in enumerate(entry.records):
                outcome = outcomes.get(id(record))
                if not isinstance(outcome, _REFUSED_RECORD) or record.letter is None:
                    continue
                log.error("the dead-letter topic refused a dead letter (%r); shrinking it", outcome)
                entry.records[i] = self._smallest(record, record.letter)

    def _smallest(self, record: OutRecord, letter: DeadLetter) -> OutRecord:
        if letter.truncated:  # its value is a prefix already: keep a shorter one, headers only
            value = (record.value or b"")[: MIN_DEAD_LETTER_BYTES // 4]
            return replace(record, key=None, value=value, headers=letter.headers())
        return self._dead_letter(record.key, record.value, [], letter, MIN_DEAD_LETTER_BYTES)

    async def _transaction(self, partition: int) -> None:
        ledger = self.ledgers.get(partition)
        producer = self._producers.get(partition)
        if ledger is None or producer is None:
            return
        entries = self._pending.pop(partition, [])
        if not entries and ledger.commit_point() is None:
            return
        records = [r for entry in entries for r in entry.records]
        outcomes: dict[int, RecordMetadata | BaseException] = {}
        began = False
        try:
            await producer.begin_transaction()
            began = True
            sent = await self._send(producer, records)
            outcomes = {id(r): o for r, o in zip(records, sent, strict=True)}
            for outcome in sent:
                if isinstance(outcome, BaseException):
                    raise outcome
            finals = self._finals(entries, outcomes)
            point = ledger.commit_point(finals)
            if point is not None:
                tp = TopicPartition(self.settings.request_topic, partition)
                await producer.send_offsets_to_transaction(
                    {tp: (point.offset, point.metadata)}, self.settings.group_id
                )
            if finals:
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
            self._close_lanes(partition)
            self._stalls.pop(partition, None)
            self._num_pending -= len(records)
            self._discarded(entries)
            await self._stop_producer(partition)
            self._on_fenced(partition)
            return
        except KafkaError as exc:
            # Aborted: nothing of it is visible, so everything is sent again (refused dead
            # letters in their smallest form).
            log.warning("partition %d: transaction failed (%r); retrying", partition, exc)
            self._failed([partition], exc)
            with contextlib.suppress(KafkaError):
                await producer.abort_transaction()
            self._replace_refused(entries, outcomes)
            self._restore(partition, entries)
            return
        except BaseException:
            # Cancelled (or a bug) mid-transaction: leave no transaction open behind us, and
            # keep what it carried for the next cycle.
            if began:
                with contextlib.suppress(Exception):
                    await asyncio.shield(producer.abort_transaction())
            self._restore(partition, entries)
            raise
        self._num_pending -= len(records)
        ledger.finalize(finals)
        if point is not None:
            ledger.committed_at(point)
        self._succeeded([partition])
        self.metrics.commits.labels(outcome="committed").inc()

    @staticmethod
    def _finals(
        entries: list[_Entry], outcomes: dict[int, RecordMetadata | BaseException]
    ) -> dict[int, int | None]:
        """Offsets made final by ``outcomes`` (all of their records written): offset -> the
        results offset of its answer (None when it wrote no result)."""
        finals: dict[int, int | None] = {}
        for entry in entries:
            if entry.offset is None:
                continue
            results_offset = entry.results_offset
            complete = True
            for record in entry.records:
                outcome = outcomes.get(id(record))
                if outcome is None or isinstance(outcome, BaseException):
                    complete = False
                elif record.topic == entry.result_topic:
                    results_offset = int(outcome.offset)
            if complete:
                finals[entry.offset] = results_offset
        return finals

    async def _plain_cycle(self, partitions: list[int]) -> None:
        """Send what is pending; what was acknowledged is done (never sent again), what failed
        is kept for the next cycle; commit up to the lowest offset not final."""
        producer = self._shared
        assert producer is not None
        taken = {p: self._pending.pop(p, []) for p in partitions if p in self.ledgers}
        records = [r for entries in taken.values() for e in entries for r in e.records]
        sent = await self._send(producer, records)
        outcomes = {id(r): o for r, o in zip(records, sent, strict=True)}
        failed = [o for o in sent if isinstance(o, BaseException)]
        points: dict[int, CommitPoint] = {}
        failing: list[int] = []
        for partition, entries in taken.items():
            finals = self._finals(entries, outcomes)
            self._replace_refused(entries, outcomes)
            left = self._keep_unwritten(entries, outcomes)
            if left:
                failing.append(partition)
                self._restore(partition, left)
            ledger = self.ledgers.get(partition)
            if ledger is None:
                continue
            ledger.finalize(finals)
            point = ledger.commit_point()
            if point is not None:
                points[partition] = point
        if failed:
            log.warning(
                "%d of %d records could not be written (%r); the next cycle retries them",
                len(failed),
                len(records),
                failed[0],
            )
            self._failed(failing, failed[0])
        if not points:
            return
        if any(e.offset is not None for entries in taken.values() for e in entries):
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
            self._failed(list(points), exc)
            return
        for partition, point in points.items():
            ledger = self.ledgers.get(partition)
            if ledger is not None:
                ledger.committed_at(point)
        self._succeeded([p for p in taken if p not in failing])
        self.metrics.commits.labels(outcome="committed").inc()

    def _keep_unwritten(
        self, entries: list[_Entry], outcomes: dict[int, RecordMetadata | BaseException]
    ) -> list[_Entry]:
        """Drop every acknowledged record from ``entries``; the entries with records left."""
        left = []
        for entry in entries:
            for record in list(entry.records):
                outcome = outcomes.get(id(record))
                if outcome is not None and not isinstance(outcome, BaseException):
                    entry.written(record, outcome)
                    self._num_pending -= 1
            if entry.records:
                left.append(entry)
        return left

    def _restore(self, partition: int, entries: list[_Entry]) -> None:
        """Put back what a cycle could not finish (before anything newer for the partition)."""
        if partition not in self.ledgers:
            self._num_pending -= sum(len(e.records) for e in entries)
            self._discarded(entries)
            return
        self._pending[partition] = entries + self._pending.get(partition, [])
