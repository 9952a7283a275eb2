"""Reply addresses (``InferenceRequest.reply``) on the embedded broker with in-process simulated
executors: the results topic keeps every answer; a request with a reply address also gets its
result (and, when asked, its tokens) on that topic partition, and nothing of anyone else's; an
address the producer cannot route to is skipped without holding the partition back; a rejected
request with a readable address is told there too; an address outside the reply namespace is
refused at intake."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvgate.admission_service.replies import reply_of
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import (
    REPLY_KIND_HEADER,
    InferenceResult,
    RejectCode,
    ResultStatus,
    TokenChunk,
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
        await produce(
            broker.bootstrap,
            topics.requests,
            [*mine, *plain, lost, no_such_partition, too_big, outside],
        )
        results = await read_results(
            broker.bootstrap, topics.results, 14, read_committed=False, settle_s=0.3
        )
        by_id = {r.request_id: r for r in results}
        assert len(results) == len(by_id) == 14  # every request answered once, reply or not
        assert by_id["lost"].status is by_id["far"].status is ResultStatus.COMPLETED
        assert by_id["big"].reject_code is RejectCode.INFEASIBLE
        assert by_id["outside"].reject_code is RejectCode.SCHEMA

        # 6 results + a rejection + the tokens of the even ones
        num_tokens = sum(len(by_id[f"m{i}"].output_token_ids) for i in (0, 2, 4))
        copies = await read_all(
            broker.bootstrap, reply_topic, until_count=6 + 1 + num_tokens, read_committed=False,
            settle_s=0.3,
        )  # fmt: skip
        assert len(copies) == 6 + 1 + num_tokens
        assert {c.partition for c in copies} == {1}
        kinds = [dict(c.headers)[REPLY_KIND_HEADER] for c in copies]
        replied = [
            InferenceResult.model_validate_json(c.value)
            for c, kind in zip(copies, kinds, strict=True)
            if kind == b"result"
        ]
        assert sorted(r.request_id for r in replied) == ["big", "m0", "m1", "m2", "m3", "m4", "m5"]
        for copy in replied:
            assert copy == by_id[copy.request_id]  # the same answer as the results topic's
        tokens: dict[str, list[TokenChunk]] = {}
        for c, kind in zip(copies, kinds, strict=True):
            if kind == b"token":
                chunk = TokenChunk.model_validate_json(c.value)
                tokens.setdefault(chunk.request_id, []).append(chunk)
        assert sorted(tokens) == ["m0", "m2", "m4"]
        for rid, chunks in tokens.items():
            assert [c.token_id for c in chunks] == by_id[rid].output_token_ids
        assert service.outbox is not None
        # "far" at least ("lost"'s topic may be auto-created by a broker that does that)
        assert service.outbox.reply_routes.skipped >= 1
    finally:
        await service.shutdown()


def test_reply_of_reads_only_a_valid_address() -> None:
    ok = {"request_id": "x", "reply": {"topic": "kvgate.replies.g1", "partition": 3}}
    assert reply_of(json.dumps(ok).encode()) is not None
    for bad in (
        b"{oops",
        b"[]",
        json.dumps({"reply": {"topic": "kvgate.results", "partition": 0}}).encode(),
        json.dumps({"reply": {"topic": "kvgate.replies.g", "partition": -1}}).encode(),
        None,
    ):
        assert reply_of(bad) is None
