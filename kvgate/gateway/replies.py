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

Delivery: replies are read with no consumer group and no commits (nothing to resume: the reply
topic is re-read from its start). A reply seen twice (an at-least-once retry in the service)
finds its waiter gone and is dropped; the first copy counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from kvgate.gateway.settings import GatewaySettings
from kvgate.protocol.records import (
    REPLY_KIND_HEADER,
    AbortRequest,
    InferenceRequest,
    InferenceResult,
    ReplyTo,
    TokenChunk,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    """One request id this replica waits for: its tokens in order, then its result."""

    tokens: asyncio.Queue[TokenChunk] = field(default_factory=asyncio.Queue)
    result: asyncio.Future[InferenceResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    users: int = 1

    def resolve(self, result: InferenceResult) -> None:
        if not self.result.done():
            self.result.set_result(result)


class ReplyBridge:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.reply = ReplyTo(topic=settings.reply_topic, partition=0)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._lookups: set[asyncio.Task[None]] = set()
        self.waiters: dict[str, Waiter] = {}
        self._answers: OrderedDict[str, InferenceResult] = OrderedDict()
        self.ready = asyncio.Event()
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self._ensure_reply_topic()
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.bootstrap_servers,
            acks="all",
            enable_idempotence=False,  # the request id, not the producer, makes retries safe
            linger_ms=1,
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.bootstrap_servers,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",  # never an answer of an aborted transaction
            # A broker that holds an empty fetch for its whole wait (Tansu does) would add up
            # to this much to every token's latency: short polls, a few per second when idle.
            fetch_max_wait_ms=20,
        )
        await self._consumer.start()
        tp = TopicPartition(self.reply.topic, self.reply.partition)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        self._task = asyncio.create_task(self._read_replies(), name="gateway-replies")
        self.ready.set()

    async def close(self) -> None:
        self.ready.clear()
        for task in [*self._lookups, *([self._task] if self._task else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await task
        if self._consumer is not None:
            await self._consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def _ensure_reply_topic(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.bootstrap_servers)
        await admin.start()
        try:
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
    async def _read_replies(self) -> None:
        assert self._consumer is not None
        try:
            while True:
                batch = await self._consumer.getmany(timeout_ms=1000)
                for messages in batch.values():
                    for message in messages:
                        self._on_reply(message.value, dict(message.headers))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("reading replies failed")
            self.failure = exc
            self.ready.clear()
            raise

    def _on_reply(self, value: bytes | None, headers: dict[str, bytes]) -> None:
        if value is None:
            return
        kind = headers.get(REPLY_KIND_HEADER)
        if kind == b"token":
            chunk = TokenChunk.model_validate_json(value)
            waiter = self.waiters.get(chunk.request_id)
            if waiter is not None:
                waiter.tokens.put_nowait(chunk)
        elif kind == b"result":
            self.answered(InferenceResult.model_validate_json(value))

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
        waiter = Waiter()
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
        """Produce ``request`` (keyed by its id, so every copy of an id shares a partition) with
        ``headers`` (the trace context); with ``look_up_in`` (a results topic) also watch that
        partition for its answer."""
        assert self._producer is not None
        sent = await self._producer.send_and_wait(
            topic,
            request.model_dump_json(exclude_none=True).encode(),
            key=request.request_id.encode(),
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
            bootstrap_servers=self.settings.bootstrap_servers,
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
