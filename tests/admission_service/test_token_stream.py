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
from kvgate.admission_service.settings import KafkaSettings
from kvgate.protocol.records import (
    InferenceResult,
    ReplyTo,
    ResultStatus,
    SourceRef,
    Timings,
    TokenChunk,
    Usage,
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


def chunk(index: int) -> TokenChunk:
    return TokenChunk(request_id="r", index=index, token_id=7 + index, exit_depth=1)


def result() -> InferenceResult:
    return InferenceResult(
        request_id="r", status=ResultStatus.COMPLETED,
        usage=Usage(prompt_tokens=1, completion_tokens=1), timings=Timings(end_to_end_s=0.1),
        source=SOURCE,
    )  # fmt: skip


async def started(producer: Producer, *, transactional: bool) -> Outbox:
    commits: list[dict[Any, OffsetAndMetadata]] = []

    async def commit_offsets(offsets: dict[Any, OffsetAndMetadata]) -> None:
        commits.append(offsets)
        producer.log.append(("commit offsets", None))

    box = Outbox(
        KAFKA, transactional=transactional, producer_factory=lambda _txn_id: producer,  # type: ignore[arg-type,return-value]
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
    box.token(SOURCE, chunk(0), REPLY)
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
    box.token(SOURCE, chunk(0), REPLY)  # to the token topic and the reply address: both fail
    box.token(SOURCE, chunk(1), REPLY)
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
    box.token(SOURCE, chunk(0), REPLY)
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
