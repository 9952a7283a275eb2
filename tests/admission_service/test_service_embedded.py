"""The whole service on the embedded broker (Tansu, no transactions) with in-process simulated
executors: consume → schedule → answer for a mixed workload with bad input, the token stream,
aborts, backpressure, and a graceful shutdown that commits and hands off.

The same behaviours against real Kafka, with real processes, transactions and crashes, are in
tests/integration/test_admission_*.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import ServiceSettings, load_settings
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.admin import ExecutorSpec
from kvgate.protocol.records import (
    DLQ_CODE_HEADER,
    RejectCode,
    ResultStatus,
)
from kvgate.sim.backend import LocalConnector, LocalSession, SimBackend, SimExecutorConfig
from kvgate.sim.server import read_tokenizer_files, sim_step_server
from tests.admission_service.word_tokenizers import word_tokenizer

from .helpers import reference_outputs, request_body, until
from .kafka_helpers import (
    Topics,
    committed_offsets,
    produce,
    read_dead_letters,
    read_results,
    read_token_chunks,
)

pytestmark = pytest.mark.timeout(120)
SIM = SimExecutorConfig(num_blocks=40, block_size=4, host_snapshot_blocks=16)


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


def settings_for(broker: EmbeddedBroker, topics: Topics, **sections: Any) -> ServiceSettings:
    kafka = topics.kafka_settings(
        broker.bootstrap,
        partitions=2,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        exactly_once="auto",
        commit_interval_ms=50,
        **sections.pop("kafka", {}),
    )
    members = [
        {"name": n, "endpoint": f"ws://local/{n}"} for n in sections.pop("members", ["a", "b"])
    ]
    overrides = {
        "kafka": kafka,
        "executors": {"members": members, **sections.pop("executors", {})},
        "admin": {"host": "127.0.0.1", "port": 0, "token": "t"},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "prefill_chunk_size": 32},
        **sections,
    }
    return load_settings(None, overrides)


@pytest.fixture
async def connector() -> AsyncIterator[LocalConnector]:
    local = LocalConnector()
    local.add("a", SIM)
    local.add("b", SIM)
    yield local


async def start(settings: ServiceSettings, connector: LocalConnector) -> AdmissionService:
    service = AdmissionService(settings, connector=connector)
    await service.start()
    assert not service.exactly_once, "Tansu has no transactions: the service must detect it"
    return service


async def test_mixed_workload_with_bad_input_and_token_stream(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("mixed")
    settings = settings_for(broker, topics, kafka={"token_topic": topics.tokens})
    service = await start(settings, connector)
    try:
        good = [
            request_body(f"g{i}", prompt_len=6 + i % 9, max_tokens=4 + i % 7, priority=i % 3)
            for i in range(20)
        ]
        bad: list[dict[str, Any] | bytes] = [
            b"{oops",
            {"request_id": "schema-bad", "prompt": [1], "bogus": True},
            {"request_id": "too-big", "prompt": list(range(1, 400)), "max_tokens": 4},
            {"request_id": "g3", "prompt": [1, 2], "max_tokens": 30},  # g3 is in flight
        ]
        connector.backends["a"].hold()
        connector.backends["b"].hold()
        await produce(broker.bootstrap, topics.requests, good)
        await until(
            lambda: service.engine is not None and service.engine.num_tracked == 20,
            what="all queued",
        )
        await produce(broker.bootstrap, topics.requests, bad)
        # Every record read while the first g3 is still held: the second one is a duplicate.
        await until(lambda: service.metrics.received._value.get() >= 24, what="all read")
        connector.backends["a"].release()
        connector.backends["b"].release()
        results = await read_results(
            broker.bootstrap, topics.results, 22, read_committed=False, settle_s=0.5
        )
        by_id: dict[str, list[Any]] = {}
        for result in results:
            by_id.setdefault(result.request_id, []).append(result)
        assert all(len(v) == 1 for v in by_id.values()), "one answer per request id"
        statuses = {k: [r.status for r in v] for k, v in by_id.items()}
        assert statuses["g3"] == [ResultStatus.COMPLETED], "the duplicate gets no answer"
        assert statuses["schema-bad"] == [ResultStatus.REJECTED]
        assert statuses["too-big"] == [ResultStatus.REJECTED]
        assert all(statuses[f"g{i}"][0] in (ResultStatus.COMPLETED,) for i in range(20) if i != 3)
        rejected = {
            r.request_id: r.reject_code for r in results if r.status is ResultStatus.REJECTED
        }
        assert rejected == {
            "schema-bad": RejectCode.SCHEMA,
            "too-big": RejectCode.INFEASIBLE,
        }
        letters = await read_dead_letters(broker.bootstrap, topics.dlq, 4)
        codes = sorted(letter.code.value for _, letter in letters)
        assert codes == ["duplicate", "infeasible", "malformed_json", "schema"]
        malformed = next(r for r, letter in letters if letter.code is RejectCode.MALFORMED_JSON)
        assert malformed.value == b"{oops"  # the original bytes, untouched
        assert dict(malformed.headers)[DLQ_CODE_HEADER] == b"malformed_json"
        # Token stream: every completed request's tokens, in order, on its request's partition.
        completed = [r for r in results if r.status is ResultStatus.COMPLETED]
        chunks = await read_token_chunks(
            broker.bootstrap,
            topics.tokens,
            until_count=sum(len(r.output_token_ids) for r in completed),
        )
        for result in completed:
            mine = [(p, c) for p, c in chunks if c.request_id == result.request_id]
            assert [c.token_id for _, c in mine] == result.output_token_ids
            assert {p for p, _ in mine} == {result.source.partition}
        # Latency and token metrics by priority agree with the results on Kafka.
        priority = {body["request_id"]: body.get("priority", 0) for body in good}
        metric = service.metrics.registry.get_sample_value
        for p in (0, 1, 2):
            mine = [r for r in completed if priority[r.request_id] == p]
            label = {"model": service.settings.telemetry.model_name, "priority": str(p)}
            tokens = sum(r.usage.completion_tokens for r in mine)
            assert metric("kvgate_admission_generation_tokens_total", label) == tokens
            prompt = sum(r.usage.prompt_tokens for r in mine)
            extra = sum(r.usage.prompt_tokens for r in results if r.request_id == "too-big")
            assert metric("kvgate_admission_prompt_tokens_total", label) == prompt + (
                extra if p == 0 else 0
            )
            assert metric("kvgate_admission_time_to_first_token_seconds_count", label) == len(mine)
            ttft = sum(r.timings.time_to_first_token_s or 0.0 for r in mine)
            seen = metric("kvgate_admission_time_to_first_token_seconds_sum", label)
            assert seen == pytest.approx(ttft, abs=1e-3)
            done = {**label, "status": "completed"}
            assert metric("kvgate_admission_request_latency_seconds_count", done) == len(mine)
    finally:
        await service.shutdown()


async def test_abort_topic_cancels_running_and_later_requests(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("aborts")
    service = await start(settings_for(broker, topics), connector)
    try:
        connector.backends["a"].hold()
        connector.backends["b"].hold()
        await produce(broker.bootstrap, topics.requests, [request_body("long", max_tokens=50)])
        await until(lambda: service.engine is not None and service.engine.num_tracked == 1)
        await produce(
            broker.bootstrap,
            topics.aborts,
            [{"request_id": "long"}, {"request_id": "later"}, b"junk"],
        )
        await until(lambda: service.metrics.aborts._value.get() >= 2, what="aborts read")
        connector.backends["a"].release()
        connector.backends["b"].release()
        await produce(
            broker.bootstrap, topics.requests, [request_body("later"), request_body("normal")]
        )
        results = {
            r.request_id: r
            for r in await read_results(broker.bootstrap, topics.results, 3, read_committed=False)
        }
        assert results["long"].status is ResultStatus.ABORTED
        assert results["later"].status is ResultStatus.ABORTED
        assert results["normal"].status is ResultStatus.COMPLETED
    finally:
        await service.shutdown()


async def test_backpressure_pauses_and_resumes_intake(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("backpressure")
    settings = settings_for(
        broker,
        topics,
        limits={"max_waiting_requests": 10, "resume_waiting_requests": 4},
        kafka={"max_poll_records": 5},
    )
    service = await start(settings, connector)
    try:
        connector.backends["a"].hold()
        connector.backends["b"].hold()
        await produce(
            broker.bootstrap,
            topics.requests,
            [request_body(f"bp{i}", max_tokens=3) for i in range(40)],
        )
        intake = service.intake
        assert intake is not None and service.engine is not None
        await until(lambda: intake.paused, what="intake paused")
        read_while_paused = service.engine.num_tracked
        assert 10 <= read_while_paused < 40, "the pause must stop reading well before the end"
        assert (
            "kvgate_admission_paused 1.0"
            in __import__("prometheus_client").generate_latest(service.metrics.registry).decode()
        )
        connector.backends["a"].release()
        connector.backends["b"].release()
        await until(lambda: not intake.paused, what="intake resumed")
        results = await read_results(broker.bootstrap, topics.results, 40, read_committed=False)
        assert len({r.request_id for r in results}) == 40
    finally:
        await service.shutdown()


async def test_graceful_shutdown_commits_answers_and_hands_off_the_rest(
    broker: EmbeddedBroker, connector: LocalConnector
) -> None:
    topics = Topics.unique("shutdown")
    settings = settings_for(broker, topics, shutdown={"grace_period_s": 0.0})
    bodies = [request_body(f"s{i}", max_tokens=6) for i in range(12)]
    service = await start(settings, connector)
    await produce(broker.bootstrap, topics.requests, bodies[:6])
    first = await read_results(broker.bootstrap, topics.results, 6, read_committed=False)
    connector.backends["a"].hold()
    connector.backends["b"].hold()
    await produce(broker.bootstrap, topics.requests, bodies[6:])
    await until(
        lambda: service.engine is not None and service.engine.num_tracked == 6,
        what="second half queued",
    )
    await service.shutdown()  # grace 0: the six running ones are handed off
    connector.backends["a"].release()
    connector.backends["b"].release()
    committed = await committed_offsets(broker.bootstrap, topics.group, topics.requests, 2)
    answered = {(r.source.partition, r.source.offset) for r in first}
    for partition, offset in committed.items():
        below = {o for p, o in answered if p == partition}
        assert set(range(offset)) <= below, "committed past an unanswered request"
    # A new instance answers exactly the handed-off ones.
    successor = await start(settings, connector)
    try:
        results = await read_results(
            broker.bootstrap, topics.results, 12, read_committed=False, settle_s=1.0
        )
        counts: dict[str, int] = {}
        for result in results:
            counts[result.request_id] = counts.get(result.request_id, 0) + 1
        assert counts == {f"s{i}": 1 for i in range(12)}
    finally:
        await successor.shutdown()
    final = await committed_offsets(broker.bootstrap, topics.group, topics.requests, 2)
    ends = {p: sum(1 for r in results if r.source.partition == p) for p in range(2)}
    assert final == ends, "a clean shutdown commits everything answered"
    json.dumps(final)


class _NoCloseHandshake(LocalConnector):
    """Executors whose close handshake never completes (a hung or partitioned peer)."""

    async def __call__(self, endpoint: str, epoch: int) -> LocalSession:
        session = await super().__call__(endpoint, epoch)
        never = asyncio.Event()

        async def close() -> None:
            await never.wait()

        session.close = close  # type: ignore[method-assign]
        return session


async def test_shutdown_leaves_a_hung_executor_within_the_closing_budget(
    broker: EmbeddedBroker,
) -> None:
    connector = _NoCloseHandshake()
    connector.add("a", SIM)
    connector.add("b", SIM)
    topics = Topics.unique("hung")
    settings = settings_for(
        broker, topics, shutdown={"grace_period_s": 0.0, "closing_timeout_s": 1.0}
    )
    bodies = [request_body(f"h{i}", max_tokens=4) for i in range(6)]
    service = await start(settings, connector)
    await produce(broker.bootstrap, topics.requests, bodies)
    answered = await read_results(broker.bootstrap, topics.results, 6, read_committed=False)
    # Without the budget this never returns: both close handshakes wait forever.
    assert await asyncio.wait_for(service.shutdown(), 20.0) == 0
    committed = await committed_offsets(broker.bootstrap, topics.group, topics.requests, 2)
    ends = {p: sum(1 for r in answered if r.source.partition == p) for p in range(2)}
    assert committed == ends, "what was answered is still committed"


async def test_a_drain_migrates_requests_with_their_kv_through_the_whole_service(
    broker: EmbeddedBroker,
) -> None:
    """Kafka in, a drain with migration (the service default), Kafka out: one answer per
    request, outputs equal to a run without the drain, the moved requests recompute nothing."""
    roomy = SimExecutorConfig(num_blocks=128, block_size=4, host_snapshot_blocks=512)
    local = LocalConnector()
    local.add("a", roomy)
    topics = Topics.unique("migrate")
    bodies = [
        request_body(f"v{i}", prompt_len=5 + (i * 7) % 13, max_tokens=14 + i % 5) for i in range(6)
    ]
    expected = await reference_outputs(bodies, block_size=4)
    service = await start(settings_for(broker, topics, members=["a"]), local)
    try:
        engine = service.engine
        assert engine is not None
        local.backends["a"].hold_after(5)
        await produce(broker.bootstrap, topics.requests, bodies)
        await until(lambda: local.backends["a"]._held, what="a held mid-decode")
        local.add("b", roomy)
        members = [
            ExecutorSpec(name="a", endpoint="ws://local/a", draining=True),
            ExecutorSpec(name="b", endpoint="ws://local/b"),
        ]
        await engine.set_members(members)
        await until(lambda: engine.handles["b"].accepts_work, what="b ready")
        local.backends["a"].release()
        results = await read_results(
            broker.bootstrap, topics.results, len(bodies), read_committed=False, settle_s=0.5
        )
        assert sorted(r.request_id for r in results) == sorted(expected), "one answer each"
        assert {r.request_id: r.output_token_ids for r in results} == {
            rid: tokens for rid, (tokens, _) in expected.items()
        }
        metric = service.metrics.registry.get_sample_value

        def migrations(outcome: str) -> float:
            return metric("kvgate_admission_migrations_total", {"outcome": outcome}) or 0

        migrated = migrations("migrated")
        assert migrated >= 1
        # A request still waiting on "a" when it drained (not yet admitted: a slow machine reads
        # the records in several polls) moves without KV ("no_kv"); none may fall back to recompute.
        assert migrations("not_migratable") == 0
        moved = [r for r in results if r.scheduling.executors == ["a", "b"]]
        assert len(moved) == migrated + migrations("no_kv")
        assert all(r.scheduling.recomputed_tokens == 0 for r in moved)
    finally:
        await service.shutdown()


async def test_a_text_read_before_any_executor_waits_for_the_pools_tokenizer(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """A replica that has partitions but no executor yet (just started, or given its shard a
    moment later) holds text prompts until an executor serves the pool's tokenizer, instead
    of rejecting them; token-id prompts are queued meanwhile as always."""
    backend = SimBackend(SimExecutorConfig())
    backend.tokenizer_files = read_tokenizer_files(word_tokenizer(tmp_path / "words", 1))
    server = sim_step_server(backend, "step-token")
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await server.wait_loaded()
    endpoint = f"ws://127.0.0.1:{runner.addresses[0][1]}/v1/steps"
    topics = Topics.unique("tokenizer-wait")
    settings = settings_for(
        broker,
        topics,
        members=[],
        executors={"token": "step-token", "tokenizer_from_executors": True},
    )
    service = AdmissionService(settings)
    await service.start()
    try:
        text = request_body("words", prompt="the cat sat on the mat", max_tokens=3)
        await produce(broker.bootstrap, topics.requests, [text, request_body("ids")])
        await until(lambda: service.metrics.received._value.get() >= 2, what="both read")
        assert service.engine is not None
        await service.engine.set_members([ExecutorSpec(name="exec", endpoint=endpoint)])
        results = await read_results(
            broker.bootstrap, topics.results, 2, read_committed=False, settle_s=0.5
        )
        statuses = {r.request_id: (r.status, r.reason) for r in results}
        assert statuses == {
            "words": (ResultStatus.COMPLETED, None),
            "ids": (ResultStatus.COMPLETED, None),
        }
    finally:
        await service.shutdown()
        await runner.cleanup()
