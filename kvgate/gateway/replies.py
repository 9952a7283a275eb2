"""The gateway's side of Kafka: requests out, its own reply partition in, aborts out, and the
look-up of an answer by request id in a pool's results partition (idempotent retries).

```
HTTP ─▶ produce InferenceRequest(reply = kvgate.replies.<replica>/0) ─▶ kvgate.requests
                                                                          │ service
HTTP ◀─ waiter[request_id] ◀─ reply consumer ◀─ kvgate.replies.<replica> ◀┘ (result copy,
                                                                            tokens if streamed)
```

Each replica reads only its reply topic (one partition, read from its start so that answers
that came while it was down fill the answer cache). A request with a client-chosen id whose
answer this replica does not hold also reads the results partition its copy was produced to
(from the start: the answer may be older than this process, or in flight under another
replica's reply address) until one of the two answers: a retry after a restart, or on another
replica, gets the same answer. Ids the gateway makes up are new, so they skip the look-up.

Delivery: replies are read with no consumer group and no commits (nothing to resume), by two
readers of the one partition:

- results, ``read_committed`` (never an answer of an aborted transaction), from the topic's
  start: answers that came while this replica was down fill the answer cache. A result seen
  twice (an at-least-once retry in the service) finds its waiter resolved; the first counts.
- token chunks, ``read_uncommitted``, from the end at start (older chunks are nobody's).
  Chunks are never written in a transaction, but a ``read_committed`` reader would still hold
  them behind any transaction open on the partition (the last stable offset: another request's
  result copy being committed), in bursts of the service's commit cycle. Chunks are
  at-least-once — a request run again after a hand-off streams from index 0 again, and a
  retried chunk can come late — so each waiter keeps the first chunk of every (choice, index)
  and passes them on in index order (:meth:`Waiter.offer`). A record holds a step's chunks for
  this partition (``TokenChunks``, header ``tokens``) or, from a service writing a record per
  token, one chunk (``token``); both are read.

Fetches: Kafka answers a fetch as soon as a record arrives, so ``reply_fetch_max_wait_ms`` only
sets how often an idle reader asks; a broker that holds an empty fetch for its whole wait
(Tansu, the embedded broker) adds up to that much to every reply, and the local stack sets a
short one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from pydantic import ValidationError

from kvgate.gateway.settings import GatewaySettings
from kvgate.kafka_connection import client_options
from kvgate.protocol.records import (
    REPLY_KIND_RESULT,
    TOKEN_KINDS,
    AbortRequest,
    InferenceRequest,
    InferenceResult,
    ReplyTo,
    TokenChunk,
    reply_kind,
    token_chunks_of,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Choice:
    """What one choice of a request has streamed: its token ids by index (passed on), chunks
    that came ahead of a missing index, and the first index a re-run produced differently."""

    token_ids: list[int] = field(default_factory=list)
    early: dict[int, TokenChunk] = field(default_factory=dict)
    diverged_at: int | None = None


@dataclass(eq=False)
class Waiter:
    """One request id this replica waits for: its tokens, each once and in index order per
    choice, then its result."""

    request_id: str
    tokens: asyncio.Queue[TokenChunk] = field(default_factory=asyncio.Queue)
    result: asyncio.Future[InferenceResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    users: int = 1
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def offer(self, chunk: TokenChunk) -> None:
        """Pass ``chunk`` on once, in index order within its choice: the first chunk of a
        (choice, index) counts, a later one is a copy (an at-least-once retry, or a re-run after
        a hand-off) and is dropped.

        A re-run whose token differs from what was passed on (numerics that depend on the
        batch) cannot be unsent: from that index on nothing more of the choice is streamed, and
        the result, the truth, ends the stream.
        """
        choice = self._choices.setdefault(chunk.choice, _Choice())
        if choice.diverged_at is not None:
            return
        if chunk.index < len(choice.token_ids):
            if choice.token_ids[chunk.index] != chunk.token_id:
                choice.diverged_at = chunk.index
                log.warning(
                    "request %s ran again and its token %d (choice %d) differs from the one "
                    "streamed: nothing more of it is streamed, the result ends the stream",
                    self.request_id,
                    chunk.index,
                    chunk.choice,
                )
            return
        choice.early.setdefault(chunk.index, chunk)
        while (ready := choice.early.pop(len(choice.token_ids), None)) is not None:
            choice.token_ids.append(ready.token_id)
            self.tokens.put_nowait(ready)

    def diverged_at(self, choice: int = 0) -> int | None:
        """The first index where a re-run of ``choice`` differed from what was streamed."""
        state = self._choices.get(choice)
        return None if state is None else state.diverged_at

    def resolve(self, result: InferenceResult) -> None:
        if not self.result.done():
            self.result.set_result(result)


def partition_key(request: InferenceRequest, *, idempotent: bool) -> bytes:
    """The request record's Kafka key, which picks its partition and so the admission replica
    (shard) that runs it.

    - An idempotent request (a client's ``Idempotency-Key``) is keyed by its id: every copy of
      an id must reach the partition whose owner answers it once.
    - Otherwise by its ``affinity_key`` (``prompt_cache_key``, else ``user``) when it has one:
      a conversation's turns land on one shard, whose placement keeps them on the executor
      that holds their prefix.
    - Otherwise by its id (spread evenly). Not by the prompt's first pages: a system prompt
      every request shares would pile the whole pool onto one partition.
    """
    if request.affinity_key is not None and not idempotent:
        return request.affinity_key.encode()
    return request.request_id.encode()


class ReplyBridge:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.reply = ReplyTo(topic=settings.reply_topic, partition=0)
        self._producer: AIOKafkaProducer | None = None
        self._readers: list[AIOKafkaConsumer] = []  # results, then tokens
        self._tasks: list[asyncio.Task[None]] = []
        self._lookups: set[asyncio.Task[None]] = set()
        self.waiters: dict[str, Waiter] = {}
        self._answers: OrderedDict[str, InferenceResult] = OrderedDict()
        self.ready = asyncio.Event()
        self.failure: BaseException | None = None
        self._options: dict[str, Any] = {}  # aiokafka's keyword arguments, made at start

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect (TLS and SASL as ``settings.kafka`` says: the password file and TLS files
        are read now, so a bad one fails the start), create the reply topic, start reading."""
        self._options = client_options(self.settings.kafka)
        await self._ensure_reply_topic()
        self._producer = AIOKafkaProducer(
            **self._options,
            acks="all",
            enable_idempotence=False,  # the request id, not the producer, makes retries safe
            linger_ms=0,  # one request per record: nothing to wait for
        )
        await self._producer.start()
        tp = TopicPartition(self.reply.topic, self.reply.partition)
        results = await self._reader(tp, "read_committed")
        await results.seek_to_beginning(tp)
        tokens = await self._reader(tp, "read_uncommitted")
        await tokens.seek_to_end(tp)
        await tokens.position(tp)  # "the end" now, not at the first fetch
        self._tasks = [
            asyncio.create_task(self._read(results, {REPLY_KIND_RESULT}), name="gateway-results"),
            asyncio.create_task(self._read(tokens, TOKEN_KINDS), name="gateway-tokens"),
        ]
        self.ready.set()

    async def _reader(self, tp: TopicPartition, isolation: str) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            **self._options,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=isolation,
            fetch_max_wait_ms=self.settings.reply_fetch_max_wait_ms,
        )
        self._readers.append(consumer)
        await consumer.start()
        consumer.assign([tp])
        return consumer

    async def close(self) -> None:
        self.ready.clear()
        for task in [*self._lookups, *self._tasks]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await task
        for consumer in self._readers:
            await consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def _ensure_reply_topic(self) -> None:
        admin = AIOKafkaAdminClient(**self._options)
        try:
            await admin.start()
            config = {"retention.ms": str(self.settings.reply_retention_ms)}
            with contextlib.suppress(TopicAlreadyExistsError):
                response = await admin.create_topics(
                    [NewTopic(self.reply.topic, 1, 1, topic_configs=config)]
                )
                for _, code, *_ in getattr(response, "topic_errors", ()):
                    if code not in (0, TopicAlreadyExistsError.errno):
                        raise KafkaError(f"creating {self.reply.topic}: error code {code}")
        finally:
            await admin.close()

    # ------------------------------------------------------------------ replies in
    async def _read(self, consumer: AIOKafkaConsumer, kinds: Collection[bytes]) -> None:
        """Hand every reply of ``kinds`` (``REPLY_KIND_HEADER``) on; the other reader takes the
        rest."""
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=1000)
                for messages in batch.values():
                    for message in messages:
                        kind = reply_kind(message.headers)
                        if message.value is not None and kind in kinds:
                            self._on_reply(kind, message.value)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("reading replies failed")
            self.failure = exc
            self.ready.clear()
            raise

    def _on_reply(self, kind: bytes | None, value: bytes) -> None:
        try:
            if kind in TOKEN_KINDS:
                for chunk in token_chunks_of(kind, value):
                    waiter = self.waiters.get(chunk.request_id)
                    if waiter is not None:
                        waiter.offer(chunk)
                return
            result = InferenceResult.model_validate_json(value)
        except ValidationError as exc:  # not a service's record: nothing of it can be used
            log.warning("skipping a %r reply that does not parse: %s", kind, exc)
            return
        self.answered(result)

    def answered(self, result: InferenceResult) -> None:
        self._remember(result)
        waiter = self.waiters.get(result.request_id)
        if waiter is not None:
            waiter.resolve(result)

    def _remember(self, result: InferenceResult) -> None:
        limit = self.settings.answer_cache_size
        if limit == 0 or result.request_id in self._answers:
            return
        self._answers[result.request_id] = result
        while len(self._answers) > limit:
            self._answers.popitem(last=False)

    def known_answer(self, request_id: str) -> InferenceResult | None:
        return self._answers.get(request_id)

    # ------------------------------------------------------------------ requests out
    def join(self, request_id: str) -> tuple[Waiter, bool]:
        """The waiter of ``request_id`` and whether it is new (False: another HTTP request
        with this id is waiting already, and shares its answer)."""
        waiter = self.waiters.get(request_id)
        if waiter is not None:
            waiter.users += 1
            return waiter, False
        waiter = Waiter(request_id)
        self.waiters[request_id] = waiter
        return waiter, True

    def leave(self, request_id: str, waiter: Waiter) -> None:
        waiter.users -= 1
        if waiter.users <= 0 and self.waiters.get(request_id) is waiter:
            del self.waiters[request_id]

    async def send(
        self,
        topic: str,
        request: InferenceRequest,
        *,
        look_up_in: str | None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Produce ``request`` with ``headers`` (the trace context), keyed by
        ``partition_key``; with ``look_up_in`` (a results topic: the request is idempotent)
        also watch that partition for its answer."""
        assert self._producer is not None
        sent = await self._producer.send_and_wait(
            topic,
            request.model_dump_json(exclude_none=True).encode(),
            key=partition_key(request, idempotent=look_up_in is not None),
            headers=headers,
        )
        if look_up_in is not None:
            task = asyncio.create_task(
                self._look_up(look_up_in, int(sent.partition), request.request_id)
            )
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)

    async def _look_up(self, topic: str, partition: int, request_id: str) -> None:
        """Read the results partition from its start until ``request_id``'s answer is found
        or nobody waits for it any more."""
        consumer = AIOKafkaConsumer(
            **self._options,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        await consumer.start()
        key = request_id.encode()
        try:
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            while request_id in self.waiters:
                batch = await consumer.getmany(tp, timeout_ms=500)
                for message in batch.get(tp, ()):
                    if message.key == key and message.value is not None:
                        self.answered(InferenceResult.model_validate_json(message.value))
                        return
        finally:
            await consumer.stop()

    async def abort(self, request_id: str) -> None:
        assert self._producer is not None
        body = AbortRequest(request_id=request_id).model_dump_json().encode()
        await self._producer.send_and_wait(self.settings.abort_topic, body, key=request_id.encode())
