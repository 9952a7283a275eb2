"""Token chunks leave the moment they are made, outside the commit cycles (``token_stream.py``),
against a scripted producer: a chunk is sent before any cycle and outside every transaction; a
chunk whose send fails (at once, or when the broker answers) goes out with the partition's next
cycle; a partition that left drops its failed chunks (its next owner streams them again); and an
answer somebody waits for (a reply address) starts a commit cycle at once instead of waiting out
``commit_interval_ms``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import OffsetAndMetadata

from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.offsets import PartitionLedger
from kvgate.admission_service.outbox import Outbox
from kvgate.admission_service.replies import ReplyRoutes
from kvgate.admission_service.settings import KafkaSettings
from kvgate.admission_service.token_stream import StreamLane, StreamTarget, TokenStream
from kvgate.protocol.records import (
    REPLY_KIND_HEADER,
    REPLY_KIND_TOKEN,
    REPLY_KIND_TOKENS,
    InferenceResult,
    ReplyTo,
    ResultStatus,
    SourceRef,
    Timings,
    TokenChunk,
    TokenLogprob,
    TokenRecords,
    Usage,
    chunk_head,
    plain_chunk_json,
    stream_json,
    token_chunks_of,
)

from .helpers import until

pytestmark = pytest.mark.timeout(30)
# A commit interval no test waits out: whatever happens, happens for another reason.
KAFKA = KafkaSettings(
    bootstrap_servers="k:1", request_topic="req", result_topic="res", dlq_topic="dlq",
    token_topic="tok", commit_interval_ms=60_000,
)  # fmt: skip
REPLY = ReplyTo(topic="kvgate.replies.gw", partition=0, tokens=True)
SOURCE = SourceRef(topic="req", partition=0, offset=0)


@dataclass
class Cluster:
    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}


@dataclass
class Client:
    cluster: Cluster = field(default_factory=Cluster)


@dataclass
class Producer:
    """Records what is sent, and whether inside a transaction. ``refuse_sends`` token sends
    are refused when queued, ``fail_acks`` fail when the broker answers, and with ``hold_acks``
    they wait in ``held`` for the test to answer them."""

    log: list[tuple[str, Any]] = field(default_factory=list)
    client: Client = field(default_factory=Client)
    refuse_sends: int = 0
    fail_acks: int = 0
    hold_acks: bool = False
    held: list[asyncio.Future[Any]] = field(default_factory=list)
    in_transaction: bool = False
    offset: int = 0
    # What was sent: (topic, partition, key, value, headers).
    records: list[tuple[str, int | None, bytes | None, bytes | None, list[Any]]] = field(
        default_factory=list
    )

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def begin_transaction(self) -> None:
        self.in_transaction = True
        self.log.append(("begin", None))

    async def send(self, topic: str, value: bytes | None, **kw: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        is_token = topic in ("tok", REPLY.topic) and b'"index"' in (value or b"")
        if is_token and self.refuse_sends:
            self.refuse_sends -= 1
            raise KafkaTimeoutError()
        if is_token and self.hold_acks:
            self.held.append(future)
            return future
        if is_token and self.fail_acks:
            self.fail_acks -= 1
            future.set_exception(KafkaTimeoutError())
            return future
        self.offset += 1
        future.set_result(_Sent(self.offset))
        self.log.append(("send", (topic, self.in_transaction)))
        self.records.append(
            (topic, kw.get("partition"), kw.get("key"), value, list(kw.get("headers") or ()))
        )
        return future

    async def send_offsets_to_transaction(self, offsets: Any, group: str) -> None:
        self.log.append(("offsets", None))

    async def commit_transaction(self) -> None:
        self.in_transaction = False
        self.log.append(("commit", None))

    async def abort_transaction(self) -> None:
        self.in_transaction = False
        self.log.append(("abort", None))

    def sends(self, topic: str) -> list[bool]:
        """For each record sent to ``topic``: whether it was inside a transaction."""
        return [inside for kind, value in self.log if kind == "send" for t, inside in [value]
                if t == topic]  # fmt: skip


@dataclass
class _Sent:
    offset: int


def chunk(index: int, request_id: str = "r") -> TokenChunk:
    return TokenChunk(request_id=request_id, index=index, token_id=7 + index, exit_depth=1)


def made(index: int, request_id: str = "r") -> str:
    """``chunk`` as the engine hands it to the outbox."""
    return plain_chunk_json(chunk_head(request_id), index, 7 + index, 1, 0)


def put(box: Outbox, source: SourceRef, reply: ReplyTo | None, chunk: str) -> None:
    """What the engine does with a streamed token of a request read from ``source``."""
    lane = box.lane(source, reply)
    assert lane is not None and lane.open
    box.put(lane, chunk)


def result() -> InferenceResult:
    return InferenceResult(
        request_id="r", status=ResultStatus.COMPLETED,
        usage=Usage(prompt_tokens=1, completion_tokens=1), timings=Timings(end_to_end_s=0.1),
        source=SOURCE,
    )  # fmt: skip


async def started(
    producer: Producer, *, transactional: bool, settings: KafkaSettings = KAFKA
) -> Outbox:
    commits: list[dict[Any, OffsetAndMetadata]] = []

    async def commit_offsets(offsets: dict[Any, OffsetAndMetadata]) -> None:
        commits.append(offsets)
        producer.log.append(("commit offsets", None))

    box = Outbox(
        settings, transactional=transactional, producer_factory=lambda _txn_id: producer,  # type: ignore[arg-type,return-value]
        commit_offsets=commit_offsets, metrics=ServiceMetrics(),
    )  # fmt: skip
    await box.start()
    await box.open_partition(0)
    box.track(0, PartitionLedger(committed=0))
    assert not box.read(0, 0)
    return box


async def stopped(box: Outbox, running: asyncio.Task[None]) -> None:
    box.stop_soon()
    await running


@pytest.mark.parametrize("transactional", [True, False])
async def test_a_chunk_is_sent_at_once_outside_any_transaction(transactional: bool) -> None:
    producer = Producer()
    box = await started(producer, transactional=transactional)
    running = asyncio.create_task(box.run())
    put(box, SOURCE, REPLY, made(0))
    await until(lambda: len(producer.sends(REPLY.topic)) == 1, what="the chunk sent")
    assert producer.sends("tok") == [False] and producer.sends(REPLY.topic) == [False]
    assert not any(kind in ("begin", "commit", "commit offsets") for kind, _ in producer.log), (
        "no commit cycle ran: the chunk did not wait for one"
    )
    await stopped(box, running)


@pytest.mark.parametrize("how", ["refused", "failed ack"])
@pytest.mark.parametrize("transactional", [True, False])
async def test_a_chunk_that_could_not_be_streamed_goes_out_with_the_next_cycle(
    transactional: bool, how: str
) -> None:
    producer = Producer(refuse_sends=2) if how == "refused" else Producer(fail_acks=2)
    box = await started(producer, transactional=transactional)
    running = asyncio.create_task(box.run())
    put(box, SOURCE, REPLY, made(0))  # to the token topic and the reply address: both fail
    await until(lambda: box._num_pending == 2, what="both copies of the chunk back in the outbox")
    put(box, SOURCE, REPLY, made(1))
    await until(lambda: len(producer.sends("tok")) == 1, what="the second chunk streamed")
    await stopped(box, running)
    await box.flush()
    # Each topic got chunk 1 from the stream, then chunk 0 from the cycle (in its transaction
    # when there are transactions).
    assert producer.sends("tok") == [False, transactional]
    assert producer.sends(REPLY.topic) == [False, transactional]


async def test_a_chunk_failing_after_its_partition_left_is_dropped() -> None:
    producer = Producer(hold_acks=True)
    box = await started(producer, transactional=True)
    running = asyncio.create_task(box.run())
    put(box, SOURCE, REPLY, made(0))
    await until(lambda: len(producer.held) == 2, what="both copies sent, unanswered")
    assert await box.close_partition(0) == 0  # revoked while the broker has not answered
    for ack in producer.held:
        ack.set_exception(KafkaTimeoutError())
    for _ in range(3):  # the acks' callbacks run on the next turns of the loop
        await asyncio.sleep(0)
    box.track(0, PartitionLedger(committed=0))  # the partition comes back later
    await stopped(box, running)
    await box.flush()
    assert producer.sends("tok") == [] and producer.sends(REPLY.topic) == [], (
        "the old ownership's chunk is the next owner's to stream"
    )


@pytest.mark.parametrize("transactional", [True, False])
async def test_an_answer_with_a_reply_address_is_committed_at_once(transactional: bool) -> None:
    producer = Producer()
    box = await started(producer, transactional=transactional)
    running = asyncio.create_task(box.run())
    box.answer(result(), None, REPLY)
    committed = "commit" if transactional else "commit offsets"
    # Within the test's deadline, not the 60 s commit interval: the answer started a cycle.
    await until(lambda: (committed, None) in producer.log, what="a cycle committed the answer")
    assert producer.sends("res") == [transactional] and producer.sends(REPLY.topic) == [
        transactional
    ]
    await stopped(box, running)


def _chunks_sent(producer: Producer, topic: str) -> list[tuple[int | None, list[TokenChunk]]]:
    """Each record sent to ``topic``: its partition and the chunks it holds (a key-less
    ``TokenChunks`` with header ``tokens``: anything else fails here)."""
    sent = []
    for t, partition, key, value, headers in producer.records:
        if t == topic:
            assert key is None and headers == [(REPLY_KIND_HEADER, REPLY_KIND_TOKENS)]
            assert value is not None
            sent.append((partition, token_chunks_of(REPLY_KIND_TOKENS, value)))
    return sent


async def test_a_steps_chunks_are_one_record_per_topic_partition() -> None:
    """What one step makes (put before the loop turns) leaves as one record per topic partition
    and request partition, each request's chunks in order within it."""
    producer = Producer()
    box = await started(producer, transactional=True)
    await box.open_partition(1)
    box.track(1, PartitionLedger(committed=0))
    running = asyncio.create_task(box.run())
    on_1 = SourceRef(topic="req", partition=1, offset=0)
    step = [(SOURCE, made(0, "a"), REPLY), (on_1, made(0, "b"), None),
            (SOURCE, made(1, "a"), REPLY), (SOURCE, made(0, "c"), None),
            (on_1, made(0, "d"), REPLY), (on_1, made(1, "b"), None)]  # fmt: skip
    for source, one, reply in step:
        put(box, source, reply, one)
    await until(lambda: len(producer.records) == 4, what="a step's records")
    put(box, SOURCE, REPLY, made(2, "a"))  # the next step
    await until(lambda: len(producer.records) == 6, what="the next step's records")
    await stopped(box, running)
    assert _chunks_sent(producer, "tok") == [
        (0, [chunk(0, "a"), chunk(1, "a"), chunk(0, "c")]),
        (1, [chunk(0, "b"), chunk(1, "b"), chunk(0, "d")]),
        (0, [chunk(2, "a")]),
    ]
    # The reply address's partition gets a record per request partition its chunks came from
    # (a failed one goes back to that partition's commit cycle).
    assert _chunks_sent(producer, REPLY.topic) == [
        (REPLY.partition, [chunk(0, "a"), chunk(1, "a")]),
        (REPLY.partition, [chunk(0, "d")]),
        (REPLY.partition, [chunk(2, "a")]),
    ]


async def test_per_token_records_are_one_keyed_chunk_each() -> None:
    """``token_records: per_token``: the records consumers written before the batches read."""
    producer = Producer()
    settings = KAFKA.model_copy(update={"token_records": TokenRecords.PER_TOKEN})
    box = await started(producer, transactional=False, settings=settings)
    running = asyncio.create_task(box.run())
    for i in range(3):
        put(box, SOURCE, REPLY, made(i))
    await until(lambda: len(producer.records) == 6, what="a record per chunk and copy")
    await stopped(box, running)
    for topic, headers in (("tok", []), (REPLY.topic, [(REPLY_KIND_HEADER, REPLY_KIND_TOKEN)])):
        sent = [r for r in producer.records if r[0] == topic]
        assert [(key, TokenChunk.model_validate_json(value or b""), h)
                for _, _, key, value, h in sent] == [
            (b"r", chunk(i), headers) for i in range(3)
        ]  # fmt: skip


async def test_a_large_steps_chunks_are_split_below_the_record_limit() -> None:
    producer = Producer()
    failed: list[Any] = []
    stream = TokenStream(ReplyRoutes(), lambda *a: failed.append(a), max_record_bytes=400)
    stream.attach(producer)  # type: ignore[arg-type]
    chunks = [
        chunk(i, f"request-{i % 7}").model_copy(
            update={"logprob": -0.5, "top_logprobs": [TokenLogprob(token_id=j, logprob=-1.0 * j)
                                                      for j in range(3)]}
        )
        for i in range(40)
    ]  # fmt: skip
    lane = StreamLane(0, (StreamTarget("tok", 0),))
    for one in chunks:
        stream.put(lane, stream_json(one))
    stream.stop_soon()
    await stream.run()
    sent = _chunks_sent(producer, "tok")
    assert not failed and len(sent) > 4
    assert all(len(value or b"") <= 400 for *_, value, _ in producer.records)
    assert [c for _, got in sent for c in got] == chunks, "every chunk, in order"


@pytest.mark.parametrize("request_id", ["r", "a.b:c/d@e+f=g-h_i", "x" * 256])
@pytest.mark.parametrize(
    ("index", "token_id", "exit_depth", "choice"),
    [(0, 0, 1, 0), (127, 49_151, 4, 3), (10**6, 2**31, 12, 15)],
)
def test_a_plain_chunk_is_the_models_own_json(
    request_id: str, index: int, token_id: int, exit_depth: int, choice: int
) -> None:
    """The engine writes a chunk without log-probabilities by hand (no model per token): its
    text is what pydantic writes for the same chunk, so a record of both kinds reads back."""
    one = TokenChunk(
        request_id=request_id, index=index, token_id=token_id, exit_depth=exit_depth, choice=choice
    )
    text = plain_chunk_json(chunk_head(request_id), index, token_id, exit_depth, choice)
    assert text == stream_json(one)
    assert TokenChunk.model_validate_json(text) == one


async def test_a_lane_closes_when_its_partition_leaves() -> None:
    """A request's chunks go to its partition's lane while the partition is here; once it
    leaves, nothing more is streamed for it, and a partition that comes back gets new lanes."""
    box = await started(Producer(), transactional=True)
    lane = box.lane(SOURCE, REPLY)
    assert lane is not None and box.lane(SOURCE, REPLY) is lane, "one per partition and reply"
    plain = box.lane(SOURCE)
    assert plain is not None and plain is not lane and plain.targets == (StreamTarget("tok", 0),)
    await box.close_partition(0)
    assert not lane.open and not plain.open
    assert box.lane(SOURCE, REPLY) is None, "nothing streamed for a partition not here"
    box.track(0, PartitionLedger(committed=0))  # the partition comes back
    again = box.lane(SOURCE, REPLY)
    assert again is not None and again.open and again is not lane
