"""Reply addresses (``InferenceRequest.reply``) on the embedded broker with in-process simulated
executors: the results topic keeps every answer; a request with a reply address also gets its
result (and, when asked, its tokens) on that topic partition, and nothing of anyone else's; an
address the producer cannot route to is skipped without holding the partition back; a rejected
request with a readable address is told there too; an address outside the reply namespace is
refused at intake."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.validation import RawRecord, Rejection, validate_request
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import (
    REPLY_KIND_HEADER,
    REPLY_KIND_RESULT,
    InferenceResult,
    RejectCode,
    ReplyTo,
    ResultStatus,
    TokenChunk,
    token_chunks_of,
)
from kvgate.sim.backend import LocalConnector

from .helpers import request_body
from .kafka_helpers import Topics, produce, read_all, read_results
from .test_service_embedded import SIM, settings_for, start

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
async def connector() -> AsyncIterator[LocalConnector]:
    local = LocalConnector()
    local.add("a", SIM)
    local.add("b", SIM)
    yield local


async def _create(bootstrap: str, name: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def test_answers_are_copied_to_the_reply_partition_only(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("replies")
    reply_topic = f"kvgate.replies.{topics.group}"
    await _create(broker.bootstrap, reply_topic, 2)
    service = await start(settings_for(broker, topics), connector)
    try:
        mine = [
            request_body(
                f"m{i}",
                max_tokens=3 + i % 4,
                reply={"topic": reply_topic, "partition": 1, "tokens": i % 2 == 0},
            )
            for i in range(6)
        ]
        plain = [request_body(f"p{i}", max_tokens=3) for i in range(4)]
        lost = request_body(
            "lost", max_tokens=2, reply={"topic": "kvgate.replies.nobody", "partition": 0}
        )
        no_such_partition = request_body(
            "far", max_tokens=2, reply={"topic": reply_topic, "partition": 7}
        )
        too_big = request_body("big", prompt_len=400, reply={"topic": reply_topic, "partition": 1})
        outside = request_body("outside", reply={"topic": topics.results, "partition": 0})
        # Schema-bad, with a readable address: the rejection is copied there too.
        bad_body = request_body("badbody", reply={"topic": reply_topic, "partition": 1})
        bad_body["max_tokens"] = -1
        # Nested past the parser's depth under a readable key: rejected, no copy, nothing stuck.
        deep = (b"deep", b'{"request_id": "deep", "reply": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
        await produce(
            broker.bootstrap,
            topics.requests,
            [deep, *mine, *plain, lost, no_such_partition, too_big, outside, bad_body],
        )
        results = await read_results(
            broker.bootstrap, topics.results, 16, read_committed=False, settle_s=0.3
        )
        by_id = {r.request_id: r for r in results}
        assert len(results) == len(by_id) == 16  # every request answered once, reply or not
        assert by_id["lost"].status is by_id["far"].status is ResultStatus.COMPLETED
        assert by_id["big"].reject_code is RejectCode.INFEASIBLE
        assert by_id["outside"].reject_code is by_id["badbody"].reject_code is RejectCode.SCHEMA
        assert by_id["deep"].reject_code is RejectCode.MALFORMED_JSON

        # 6 results + two rejections + the tokens of the even ones
        num_tokens = sum(len(by_id[f"m{i}"].output_token_ids) for i in (0, 2, 4))
        partitions: set[int] = set()

        def copies_of(record: Any) -> list[InferenceResult | TokenChunk]:
            partitions.add(record.partition)
            kind = dict(record.headers)[REPLY_KIND_HEADER]
            if kind == REPLY_KIND_RESULT:
                return [InferenceResult.model_validate_json(record.value)]
            return list(token_chunks_of(kind, record.value))

        copies = await read_all(
            broker.bootstrap, reply_topic, until_count=6 + 2 + num_tokens, read_committed=False,
            settle_s=0.3, items=copies_of,
        )  # fmt: skip
        assert len(copies) == 6 + 2 + num_tokens
        assert partitions == {1}
        replied = [c for c in copies if isinstance(c, InferenceResult)]
        assert sorted(r.request_id for r in replied) == [
            "badbody",
            "big",
            "m0",
            "m1",
            "m2",
            "m3",
            "m4",
            "m5",
        ]
        for copy in replied:
            assert copy == by_id[copy.request_id]  # the same answer as the results topic's
        tokens: dict[str, list[TokenChunk]] = {}
        for chunk in copies:
            if isinstance(chunk, TokenChunk):
                tokens.setdefault(chunk.request_id, []).append(chunk)
        assert sorted(tokens) == ["m0", "m2", "m4"]
        for rid, chunks in tokens.items():
            assert [c.token_id for c in chunks] == by_id[rid].output_token_ids
        assert service.outbox is not None
        # "far" at least ("lost"'s topic may be auto-created by a broker that does that)
        assert service.outbox.reply_routes.skipped >= 1
    finally:
        await service.shutdown()


def _verdict(value: bytes | None, key: bytes | None = None) -> Rejection:
    record = RawRecord(topic="t", partition=0, offset=0, key=key, value=value)
    verdict = validate_request(record, LimitsSettings(), tokenizer=None)
    assert isinstance(verdict, Rejection)
    return verdict


def test_a_rejection_carries_only_a_valid_reply_address() -> None:
    address = {"topic": "kvgate.replies.g1", "partition": 3}
    schema_bad = {"request_id": "x", "prompt": "oops-not-ids", "max_tokens": -1, "reply": address}
    verdict = _verdict(json.dumps(schema_bad).encode())
    assert (verdict.request_id, verdict.reply) == (
        "x",
        ReplyTo(topic="kvgate.replies.g1", partition=3),
    )
    for bad in (
        b"{oops",
        b"[]",
        json.dumps({"request_id": "x", "reply": {"topic": "kvgate.results"}}).encode(),
        json.dumps(
            {"request_id": "x", "reply": {"topic": "kvgate.replies.g", "partition": -1}}
        ).encode(),
        None,
    ):
        assert _verdict(bad, key=b"x").reply is None


def test_hostile_nesting_with_a_readable_key_is_a_rejection_without_reply() -> None:
    """The record that stopped a partition once: the reply address was looked for by parsing
    the raw bytes a second time, outside the parser's depth guard."""
    deep = b'{"request_id": "x", "reply": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    verdict = _verdict(deep, key=b"x")
    assert (verdict.code, verdict.request_id, verdict.reply) == (
        RejectCode.MALFORMED_JSON,
        "x",
        None,
    )
