"""Token chunks out the moment the engine makes them, outside the commit cycles.

```
engine ─▶ Outbox.lane (once per request) ─▶ Outbox.put ─▶ TokenStream.put ─▶ (next loop turn)
          its partition's and reply           (chunk       one record per topic partition of
          address's lane                      JSON)        what was put ─▶ producer.send,
                                                           linger 0 ─▶ Kafka
                                                   └─ refused or failed ─▶ Outbox: the next
                                                      commit cycle sends it again
```

The engine hands each chunk over as the JSON the record will hold (``records.plain_chunk_json``:
no model per token; a record's text is its chunks' joined) to its request's lane: the chunks of
one request partition bound for one set of targets, closed when the partition leaves. A step's
chunks are all put before the loop turns, so a record holds one step's chunks for one topic
partition (``TokenChunks``, header ``kvgate-reply-kind: tokens``, no key): a step of 250 decode
rows is one producer send instead of 250 (per reply address too). ``token_records: per_token``
writes a ``TokenChunk`` per token instead (keyed by request id; reply copies with header
``token``), for consumers that predate the batches.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from kvgate.admission_service.out_records import OutRecord
from kvgate.admission_service.replies import ReplyRoutes, reply_headers
from kvgate.protocol.records import (
    REPLY_KIND_TOKEN,
    REPLY_KIND_TOKENS,
    SCHEMA_VERSION,
    TokenChunk,
)

log = logging.getLogger(__name__)

OnFailed = Callable[[int, OutRecord, BaseException], None]

# A step's chunks for one topic partition are split into records of at most about this many
# bytes (Kafka's default limits are 1 MiB a record; 250 chunks with 20 top logprobs each take
# about 250 kB, one record).
MAX_RECORD_BYTES: Final = 256 * 1024
_TOKENS_HEADERS: Final = reply_headers(REPLY_KIND_TOKENS)
# A TokenChunks record: the schema version once (its chunks leave theirs out, about 19 of 102
# bytes each), then the chunks.
_RECORD_HEAD: Final = f'{{"schema_version":{SCHEMA_VERSION},"chunks":['


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """Where chunks go: the token topic's partition, or a reply address (``reply``: skipped
    when the producer cannot route to it)."""

    topic: str
    partition: int
    reply: bool = False


@dataclass(slots=True, eq=False)
class StreamLane:
    """The chunks of one request partition bound for ``targets``, queued until the loop turns
    (the outbox keeps one per request partition and reply address)."""

    partition: int
    targets: tuple[StreamTarget, ...]
    chunks: list[str] = field(default_factory=list)
    open: bool = True  # False once its partition left: a new owner, a new lane


class TokenStream:
    """Sends what ``put`` queues on the next turn of the event loop, a record per (request
    partition, target) unless ``per_token``; ``run`` until ``stop_soon``, then what is queued
    is still handed to the producer."""

    def __init__(
        self,
        routes: ReplyRoutes,
        on_failed: OnFailed,
        *,
        per_token: bool = False,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        self._routes = routes
        self._on_failed = on_failed
        self._per_token = per_token
        self._max_record_bytes = max_record_bytes
        self._queued: list[StreamLane] = []  # lanes holding chunks, in the order first put
        self._wake = asyncio.Event()
        self._stopping = False
        self._producer: AIOKafkaProducer | None = None
        self.sent = 0  # records handed to the producer (acknowledged or not)
        self.chunks = 0  # the chunks in them (a chunk bound for two targets counted twice)

    def attach(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    def put(self, lane: StreamLane, chunk: str) -> None:
        """Queue ``chunk`` (``records.stream_json``'s text) for each of ``lane``'s targets."""
        if not lane.chunks:
            self._queued.append(lane)
            self._wake.set()
        lane.chunks.append(chunk)

    def stop_soon(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._send_queued()
            if self._stopping and not self._queued:
                return

    async def _send_queued(self) -> None:
        producer = self._producer
        assert producer is not None, "attach a producer before run"
        while self._queued:
            lanes, self._queued = self._queued, []
            groups: dict[tuple[int, StreamTarget], list[str]] = {}
            for lane in lanes:
                chunks, lane.chunks = lane.chunks, []  # a put from now on queues the lane again
                for target in lane.targets:
                    groups.setdefault((lane.partition, target), []).extend(chunks)
            for (partition, target), chunks in groups.items():
                if target.reply and not await self._routes.routable(
                    producer, target.topic, target.partition
                ):
                    continue  # counted and logged by the routes; the chunks are nobody's to read
                for record in self._records(target, chunks):
                    await self._send(producer, partition, record)
                self.chunks += len(chunks)

    def _records(self, target: StreamTarget, chunks: list[str]) -> Iterator[OutRecord]:
        if self._per_token:
            headers = reply_headers(REPLY_KIND_TOKEN) if target.reply else []
            for chunk in chunks:
                one = TokenChunk.model_validate_json(chunk)  # the whole model, as before batches
                yield OutRecord(
                    target.topic, target.partition, one.request_id.encode(),
                    one.model_dump_json().encode(), headers, reply=target.reply,
                )  # fmt: skip
            return
        value = (_RECORD_HEAD + ",".join(chunks) + "]}").encode()
        if len(value) > self._max_record_bytes and len(chunks) > 1:
            half = len(chunks) // 2
            yield from self._records(target, chunks[:half])
            yield from self._records(target, chunks[half:])
            return
        yield OutRecord(
            target.topic, target.partition, None, value, _TOKENS_HEADERS, reply=target.reply
        )

    async def _send(self, producer: AIOKafkaProducer, partition: int, record: OutRecord) -> None:
        try:
            future = await producer.send(
                record.topic, record.value, key=record.key, partition=record.partition,
                headers=record.headers,
            )  # fmt: skip
        except KafkaError as exc:  # refused before it was queued (its size, a closed client)
            self._on_failed(partition, record, exc)
            return
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
