"""Records no single one of which may stop a partition, at the production default limits, on the
embedded broker with in-process simulated executors.

Regression: a request record larger than the service's own producer limit (4 MiB at the default
``max_message_bytes`` of 1 MiB) was dead-lettered with its original bytes; the producer refused
it, the commit cycle failed and retried every ~55 ms, each retry sending again every answer
queued behind it (681 copies of the next record's dead letter in 15 s), and nothing on the
partition was ever committed — a restarted successor blocked on the same record. Meanwhile
``/readyz`` answered 200, in-flight and lag read 0, and SIGTERM exited 0 with answers unwritten.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import aiohttp
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError

from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import LimitsSettings, ServiceSettings, load_settings
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import DeadLetter, RejectCode, ResultStatus
from kvgate.sim.backend import LocalConnector, SimExecutorConfig

from .helpers import request_body, until
from .kafka_helpers import Topics, committed_offsets, read_all, read_results

pytestmark = pytest.mark.timeout(120)
SIM = SimExecutorConfig(num_blocks=64, block_size=4)
PRODUCTION = LimitsSettings()  # the defaults: what a deployment runs with
HUGE = b"x" * int(4.5 * 2**20)  # over the service producer's 4 MiB at the default limits


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
async def connector() -> AsyncIterator[LocalConnector]:
    local = LocalConnector()
    local.add("a", SIM)
    yield local


def settings_for(broker: EmbeddedBroker, topics: Topics, **kafka: Any) -> ServiceSettings:
    assert PRODUCTION.max_message_bytes == 1 << 20, "the test must run at the production limit"
    return load_settings(
        None,
        {
            "kafka": topics.kafka_settings(
                broker.bootstrap,
                partitions=1,
                session_timeout_ms=2000,
                heartbeat_interval_ms=500,
                commit_interval_ms=50,
                **kafka,
            ),
            "executors": {"members": [{"name": "a", "endpoint": "ws://local/a"}]},
            "admin": {"host": "127.0.0.1", "port": 0, "token": "t"},
        },
    )


async def produce_raw(
    bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes]]
) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=False, max_request_size=8 << 20
    )
    await producer.start()
    try:
        for key, value in records:
            await (await producer.send(topic, value, key=key))
    finally:
        await producer.stop()


def valid(n: int) -> tuple[bytes, bytes]:
    body = request_body(f"ok-{n}", max_tokens=3)
    return body["request_id"].encode(), json.dumps(body).encode()


async def test_an_oversized_record_is_truncated_into_the_dead_letter_topic_and_blocks_nothing(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("oversized")
    service = AdmissionService(settings_for(broker, topics), connector=connector)
    await service.start()
    try:
        records = [valid(0), (b"huge-1", HUGE), (None, b"not json"), *(valid(n) for n in (1, 2))]
        await produce_raw(broker.bootstrap, topics.requests, records)
        results = await read_results(
            broker.bootstrap, topics.results, 4, read_committed=False, settle_s=1.0
        )
        answers = Counter(r.request_id for r in results)
        assert answers == {"ok-0": 1, "huge-1": 1, "ok-1": 1, "ok-2": 1}, "one answer each"
        assert {r.request_id: r.status for r in results}["huge-1"] is ResultStatus.REJECTED
        letters = await read_all(broker.bootstrap, topics.dlq, until_count=2, settle_s=1.0)
        assert len(letters) == 2, "each dead letter is written once"
        huge, junk = sorted(letters, key=lambda r: DeadLetter.from_headers(r.headers).offset)
        meta = DeadLetter.from_headers(huge.headers)
        assert (meta.code, meta.topic, meta.partition, meta.offset) == (
            RejectCode.TOO_LARGE,
            topics.requests,
            0,
            1,
        )
        assert meta.truncated and meta.original_bytes == len(HUGE)
        assert meta.sha256 == hashlib.sha256(HUGE).hexdigest()
        assert huge.value is not None and HUGE.startswith(huge.value) and len(huge.value) > 0
        assert len(huge.value) + sum(len(v) for _, v in huge.headers) < PRODUCTION.max_message_bytes
        assert junk.value == b"not json" and not DeadLetter.from_headers(junk.headers).truncated
        await until(
            lambda: (
                service.outbox is not None
                and not any(service.outbox.unwritten_by_partition().values())
            ),
            what="everything written",
        )
        committed = await committed_offsets(broker.bootstrap, topics.group, topics.requests, 1)
        assert committed == {0: len(records)}
    finally:
        assert await service.shutdown() == 0


class _FailingResults(AIOKafkaProducer):  # type: ignore[misc]
    """A producer whose sends to one topic fail while ``failing`` holds it (a results topic
    that cannot be written: its leader gone, its quota exhausted, its ACLs revoked)."""

    failing: ClassVar[set[str]] = set()

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        if topic in self.failing:
            raise KafkaTimeoutError(f"cannot write {topic} (test)")
        return await super().send(topic, *args, **kwargs)


async def test_failing_commits_fail_readiness_show_the_stuck_partition_and_the_exit_status(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("stuck")
    settings = settings_for(broker, topics, commit_stall_timeout_s=0.5)
    service = AdmissionService(settings, connector=connector)
    make_producer = service._producer

    def failing_producer(transactional_id: str | None) -> AIOKafkaProducer:
        producer = make_producer(transactional_id)
        producer.__class__ = _FailingResults
        return producer

    service._producer = failing_producer  # type: ignore[method-assign]
    _FailingResults.failing = {topics.results}
    await service.start()
    unwritten = None
    try:
        base = f"http://127.0.0.1:{service.admin_port}"
        async with aiohttp.ClientSession() as http:
            await produce_raw(broker.bootstrap, topics.requests, [valid(n) for n in range(3)])
            await until(lambda: service.metrics.received._value.get() >= 3, what="all read")

            async def readyz() -> tuple[int, str]:
                async with http.get(f"{base}/readyz") as response:
                    return response.status, await response.text()

            deadline = time.monotonic() + 20
            status, body = await readyz()
            while status != 503 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                status, body = await readyz()
            assert status == 503, body
            assert "partition 0" in body and "3 answers unwritten" in body, body
            async with http.get(f"{base}/metrics") as response:
                text = await response.text()
            assert 'kvgate_admission_unwritten_answers{partition="0"} 3.0' in text
            assert "kvgate_admission_requests_in_flight 3.0" in text
            assert 'kvgate_admission_consumer_lag{partition="0"} 3.0' in text
            stalled = [
                line
                for line in text.splitlines()
                if line.startswith('kvgate_admission_commit_stalled_seconds{partition="0"}')
            ]
            assert stalled and float(stalled[0].split()[-1]) > 0, stalled
    finally:
        unwritten = await service.shutdown()
    assert unwritten == 3, "shutdown reports the answers it could not write"


async def test_one_answer_per_request_id_across_completion_and_restarts(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    """Regression: a duplicate id was caught only while its first copy ran, and then got a
    ``rejected`` result under the same id (two answers); once the first had finished, the
    same id simply ran again."""
    topics = Topics.unique("idempotent")
    settings = settings_for(broker, topics)
    backend = connector.backends["a"]
    service = AdmissionService(settings, connector=connector)
    await service.start()
    try:
        backend.hold()
        await produce_raw(broker.bootstrap, topics.requests, [valid(1), valid(1)])  # in flight
        await until(lambda: service.metrics.dead_letters._value.get() >= 1, what="in-flight dup")
        backend.release()
        await read_results(broker.bootstrap, topics.results, 1, read_committed=False)
        # After it completed: the same id again, and a bad record keyed with it.
        await produce_raw(broker.bootstrap, topics.requests, [valid(1), (b"ok-1", b"{oops")])
        await until(lambda: service.metrics.dead_letters._value.get() >= 3, what="late dups")
    finally:
        assert await service.shutdown() == 0
    successor = AdmissionService(settings, connector=connector)
    await successor.start()
    try:
        await produce_raw(broker.bootstrap, topics.requests, [valid(1), valid(2)])
        results = await read_results(
            broker.bootstrap, topics.results, 2, read_committed=False, settle_s=1.0
        )
        assert Counter(r.request_id for r in results) == {"ok-1": 1, "ok-2": 1}
        assert all(r.status is ResultStatus.COMPLETED for r in results)
        letters = await read_all(broker.bootstrap, topics.dlq, until_count=4, settle_s=0.5)
        codes = Counter(DeadLetter.from_headers(r.headers).code for r in letters)
        assert codes == {RejectCode.DUPLICATE: 3, RejectCode.MALFORMED_JSON: 1}
    finally:
        assert await successor.shutdown() == 0


class _SlowCodec:
    """A tokenizer whose every encode blocks until the test releases it (a 1 MB text costs a
    real tokenizer 0.3-1.2 s); it notes how many encodes ran at once and whether one had to
    give up waiting (which happens only if the service's loop is stuck inside it)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        self.texts: list[int] = []
        self.gave_up = False

    def encode(self, text: str) -> list[int]:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.texts.append(len(text))
        try:
            if not self.release.wait(timeout=10.0):
                self.gave_up = True
            return [1 + ord(c) % 400 for c in text[:16]]
        finally:
            with self.lock:
                self.running -= 1

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))


async def test_text_prompts_are_tokenized_off_the_loop_within_limits(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    """Regression: text prompts were tokenized on the service's only event loop before any
    length check; 60 texts of 1 MB held valid requests back for a median 25.9 s."""
    topics = Topics.unique("tokenizer")
    codec = _SlowCodec()
    service = AdmissionService(settings_for(broker, topics), connector=connector)
    service.tokenizer = codec
    await service.start()
    try:
        limit = PRODUCTION.prompt_char_limit
        texts = [
            (f"text-{n}".encode(), json.dumps(request_body(f"text-{n}", prompt="ab " * 300)))
            for n in range(6)
        ]
        too_long = request_body("text-long", prompt="x" * (limit + 1))
        records = [(k, v.encode()) for k, v in texts]
        records.append((b"text-long", json.dumps(too_long).encode()))
        records += [valid(n) for n in range(5)]
        await produce_raw(broker.bootstrap, topics.requests, records)
        # Every token-id request is answered while all the texts are still being tokenized.
        results = await read_results(broker.bootstrap, topics.results, 6, read_committed=False)
        assert {r.request_id for r in results} == {"text-long", *(f"ok-{n}" for n in range(5))}
        assert {r.request_id: r.reject_code for r in results}["text-long"] is (
            RejectCode.PROMPT_TOO_LONG
        )
        assert not codec.gave_up
        codec.release.set()
        results = await read_results(broker.bootstrap, topics.results, 12, read_committed=False)
        assert sum(r.status is ResultStatus.COMPLETED for r in results) == 11
        assert codec.most_at_once <= PRODUCTION.tokenizer_threads
        assert max(codec.texts) <= limit, "a text over the limit is never tokenized"
    finally:
        codec.release.set()
        assert await service.shutdown() == 0
