"""Scenario 5: bad-input fuzz through the whole stack.

Generated malformed and hostile records (``fuzz.py``: truncated JSON, binary garbage,
tombstones, hostile nesting, wrong types, bad encodings, bad ids, unknown fields, negative and
huge ``max_tokens``, prompts over the token and the byte limits, records over the service's own
producer limit, out-of-range values, infeasible requests, duplicate ids, bad trace context)
interleaved with valid requests, produced at once, at the production default limits. Every bad
record must reach the dead-letter topic once with its original bytes (a prefix, its size and
hash when it is too large for the topic) and a reason, and a ``rejected`` result when its id is
readable; a duplicate id gets a dead letter and no second answer; every valid request must
complete with the simulated model's outputs, the service must keep running, and its memory must
stay bounded.

Tracing is on (spans written to a file): a request with a well-formed ``traceparent`` continues
that trace, and one with a malformed header starts a trace of its own.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from kvgate.sim.backend import SimExecutorConfig
from tests.harness.kafka_client import create_topic_async
from tests.reliability.cluster import Cluster
from tests.reliability.figures import MIB, Figures
from tests.reliability.fuzz import Limits, hostile_stream
from tests.reliability.processes import rss_bytes
from tests.reliability.traffic import Expect, Sent, expected_results, read_answers
from tests.reliability.workloads import sim_reference

pytestmark = pytest.mark.timeout(900, func_only=True)

LIMITS = Limits()  # the production defaults
PARTITIONS = 4
TOPIC_MAX_BYTES = 8 << 20
# 64 blocks of 8 tokens: every valid request fits; max_prompt_tokens + max_output_tokens does not.
GEOMETRY = {"num_blocks": 64, "block_size": 8, "vocab_size": LIMITS.vocab_size}
# The records go in two bursts of the same mix. The first (the warm-up) sets the heap's
# high-water mark: a burst is fetched and queued faster than it is answered, and dead letters
# keep their original bytes until committed, so the peak holds thousands of records at once (and
# freed heap is kept by the allocator). The second burst must fit in that: resident memory may
# grow only this much more. A leak — anything kept per record after it is answered — grows with
# the record count and fails it.
GROWTH_BOUND = 16 * MIB


def _request_spans(path: Path) -> dict[tuple[int, int], dict[str, object]]:
    """Request spans by the record they were read from (partition, offset): an id alone is
    ambiguous, since every copy of a duplicate id is traced too."""
    spans = {}
    for line in path.read_text().splitlines():
        span = json.loads(line)
        attributes = span["attributes"]
        if span["name"].startswith("text_completion") and "messaging.kafka.offset" in attributes:
            where = (
                int(attributes["messaging.destination.partition.id"]),
                int(attributes["messaging.kafka.offset"]),
            )
            spans[where] = span
    return spans


def _check_trace_context(sent: list[Sent], spans: dict[tuple[int, int], dict[str, object]]) -> None:
    for item in sent:
        message = item.message
        if message.label not in ("trace context", "bad trace context"):
            continue
        span = spans[(item.partition, item.offset)]
        if message.label == "bad trace context":
            assert span["parent_span_id"] is None, f"{message.headers} became a parent"
        else:
            _, trace_id, span_id, _ = dict(message.headers)["traceparent"].decode().split("-")
            assert (span["trace_id"], span["parent_span_id"]) == (trace_id, span_id)


@pytest.mark.parametrize("total", [1500, pytest.param(12_000, marks=pytest.mark.slow, id="full")])
async def test_hostile_records_are_dead_lettered_and_valid_ones_complete(
    cluster: Cluster, figures: Figures, total: int
) -> None:
    messages, bodies = hostile_stream(total, seed=total, limits=LIMITS)
    reference = sim_reference(bodies, SimExecutorConfig(**GEOMETRY))
    # The unlucky set-up: a requests topic that takes 8 MiB records beside an existing
    # dead-letter topic with the broker's default 1 MiB limit. Dead letters that do not fit
    # are truncated copies (size, hash and source offset kept); none may stop a partition.
    await create_topic_async(
        cluster.bootstrap,
        cluster.topics.requests,
        partitions=PARTITIONS,
        configs={"max.message.bytes": str(TOPIC_MAX_BYTES)},
    )
    await create_topic_async(cluster.bootstrap, cluster.topics.dlq, partitions=PARTITIONS)
    executors = cluster.sim_executors("exec-a", "exec-b", step_time_ms=2, **GEOMETRY)
    spans_file = cluster.log_dir / "spans.jsonl"
    settings = cluster.settings(
        executors,
        limits={
            "max_prompt_tokens": LIMITS.max_prompt_tokens,
            "max_output_tokens": LIMITS.max_output_tokens,
            "max_message_bytes": LIMITS.max_message_bytes,
        },
        telemetry={"spans_file": str(spans_file)},
    )
    service = cluster.service("service", settings, env={"OTEL_SDK_DISABLED": "false"})
    rss_start = rss_bytes(service.process)

    warm_up = total // 2
    sent = await cluster.send(messages[:warm_up], max_request_size=TOPIC_MAX_BYTES)
    await read_answers(
        cluster.bootstrap, cluster.topics.results, expected_results(sent), settle_s=0
    )
    rss_warm = rss_bytes(service.process)
    await cluster.send(messages[warm_up:], max_request_size=TOPIC_MAX_BYTES)
    summary = await cluster.verify(reference, [service], executors, timeout_s=600)
    rss_end = rss_bytes(service.process)

    sent = cluster.sent
    kinds = Counter(s.message.expect for s in sent)
    bad, duplicates = kinds[Expect.DEAD_LETTER], kinds[Expect.DUPLICATE]
    oversized = sum(s.message.label == "oversized" for s in sent)
    assert summary.completed == kinds[Expect.COMPLETE]
    assert summary.dead_letters["duplicate"] == duplicates > 0, "one answer per id"
    assert sum(summary.dead_letters.values()) == bad + duplicates
    assert summary.truncated >= oversized > 0, "oversized records: truncated dead letters"
    assert service.process.alive
    assert rss_end - rss_warm < GROWTH_BOUND, (rss_start, rss_warm, rss_end)
    await asyncio.to_thread(service.process.stop)  # flushes the last spans
    _check_trace_context(sent, _request_spans(spans_file))
    figures.record(
        "fuzz",
        records=len(sent),
        bad=bad,
        valid=kinds[Expect.COMPLETE],
        duplicates=duplicates,
        oversized=oversized,
        truncated=summary.truncated,
        dead_letters=dict(summary.dead_letters),
        rss_start_mib=rss_start / MIB,
        rss_warm_mib=rss_warm / MIB,
        rss_end_mib=rss_end / MIB,
    )
