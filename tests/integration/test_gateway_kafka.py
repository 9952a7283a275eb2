"""The gateway on the real-Kafka tier: ``kvgate gateway``, ``kvgate admission-service`` with
transactions (exactly-once on) and ``kvgate sim-executor``, all real processes on 127.0.0.1,
driven by the official ``openai`` client. Reply copies travel in the service's transactions and
the gateway reads them read_committed: every request answered once, on its replica's topic."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate.protocol.records import REPLY_KIND_HEADER, InferenceResult
from tests.admission_service.kafka_helpers import Topics, read_all, read_results
from tests.harness.kafka import KafkaBroker
from tests.integration.admission_stack import (
    GATEWAY_KEY,
    service_settings,
    start_gateway,
    start_service,
    start_sim_executor,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240, func_only=True)]


# The record id of an idempotency key: the key scoped to its API key's tenant ("it", the key's
# name): the key, "@", 16 hex digits of the tenant's SHA-256 (docs/gateway.md).
SCOPE = hashlib.sha256(b"it").hexdigest()[:16]


async def _ask(api: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
    key = f"it-{i:03d}"
    rid = f"{key}@{SCOPE}"
    kwargs: dict[str, Any] = {
        "model": "sim", "prompt": [1 + i % 50, 2, 3, 4, 5], "max_tokens": 4 + i % 5,
        "extra_body": {"ignore_eos": True, "request_id": key},
    }  # fmt: skip
    if i % 2:
        chunks = await api.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        tokens = [c.usage.completion_tokens async for c in chunks if c.usage is not None]
        return rid, tokens[0]
    done = await api.completions.create(**kwargs)
    assert done.usage is not None
    return rid, done.usage.completion_tokens


async def test_gateway_over_real_kafka_with_transactions(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    topics = Topics.unique("gateway")
    executor = start_sim_executor(tmp_path, "exec-a", num_blocks=64, block_size=4)
    settings = service_settings(kafka_broker.bootstrap, topics, [executor])
    settings["kafka"]["exactly_once"] = "on"
    service = start_service(tmp_path, "service", settings)
    gateway = start_gateway(tmp_path, kafka_broker.bootstrap, topics, "it-gw")
    try:
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=GATEWAY_KEY, max_retries=0
        )
        async with api:
            answers = await asyncio.gather(*(_ask(api, i) for i in range(24)))
        assert [tokens for _, tokens in answers] == [4 + i % 5 for i in range(24)]
        results = await read_results(kafka_broker.bootstrap, topics.results, 24, settle_s=0.3)
        assert sorted(r.request_id for r in results) == sorted(rid for rid, _ in answers)
        replies = await read_all(
            kafka_broker.bootstrap, "kvgate.replies.it-gw", until_count=24, settle_s=0.3,
            read_committed=True,
        )  # fmt: skip
        copies = [
            InferenceResult.model_validate_json(r.value)
            for r in replies
            if dict(r.headers).get(REPLY_KIND_HEADER) == b"result"
        ]
        assert sorted(c.request_id for c in copies) == sorted(rid for rid, _ in answers)
        by_id = {r.request_id: r for r in results}
        assert all(c == by_id[c.request_id] for c in copies)
    finally:
        gateway.process.stop()
        service.process.stop()
        executor.process.stop()
