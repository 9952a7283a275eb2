"""``kvgate replay`` without a broker: positions, pool settings, the record → workload mapping
(against a workload written directly), and spans files in both formats against a replay."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from google.protobuf.json_format import MessageToJson
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.tokenizer import load_tokenizer
from kvgate.admission_service.tracing import StepDecisions
from kvgate.admission_service.validation import RawRecord
from kvgate.scheduler.config import SchedulerConfig
from kvgate.sim.backend import SimExecutorConfig
from kvgate.sim.replay import (
    PoolSettings,
    PoolSettingsError,
    build_workload,
    load_pool_settings,
    run_replay,
)
from kvgate.sim.replay_log import (
    LogPositionError,
    OffsetPosition,
    TimePosition,
    parse_position,
)
from kvgate.sim.replay_spans import SpansFileError, first_divergence, load_recorded_steps
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import CacheSection, ModelSection, Workload, WorkloadRequest
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.spans_file import span_record
from tests.admission_service.test_validation import _word_tokenizer
from tests.operator.examples import FULL_SPEC


def test_positions() -> None:
    assert parse_position("1200") == OffsetPosition(every=1200)
    assert parse_position("0:5,2:7") == OffsetPosition(per_partition=((0, 5), (2, 7)))
    moment = datetime(2026, 12, 1, 22, 10, tzinfo=UTC)
    assert parse_position("2026-12-01T22:10:00Z") == TimePosition(int(moment.timestamp() * 1000))
    assert parse_position("2026-12-01T22:10:00") == parse_position("2026-12-01T22:10:00+00:00")
    for bad in ("yesterday", "0:5,0:6", "-3"):
        with pytest.raises(LogPositionError):
            parse_position(bad)


def test_pool_settings_from_an_executor_pool_and_a_service_file(tmp_path: Path) -> None:
    pool = tmp_path / "pool.yaml"
    manifest = {"apiVersion": "kvgate.dev/v1", "kind": "ExecutorPool"}
    pool.write_text(yaml.safe_dump(manifest | {"metadata": {"name": "prod"}, "spec": FULL_SPEC}))
    settings = load_pool_settings(pool)
    assert settings.scheduler.max_num_seqs == 128
    assert settings.scheduler.prefill_chunk_size == 512
    assert settings.scheduler.async_scheduling  # the service's default, as the ConfigMap gets it
    service = tmp_path / "service.yaml"
    service.write_text(yaml.safe_dump({"scheduler": {"max_num_seqs": 3}, "limits": {}}))
    assert load_pool_settings(service).scheduler.max_num_seqs == 3
    service.write_text(yaml.safe_dump({"scheduler": {"max_num_seq": 3}}))
    with pytest.raises(PoolSettingsError, match="max_num_seq"):
        load_pool_settings(service)


def _record(offset: int, timestamp_ms: int, body: dict[str, object] | bytes) -> RawRecord:
    value = body if isinstance(body, bytes) else json.dumps(body).encode()
    return RawRecord("kvgate.requests", offset % 2, offset, None, value, (), timestamp_ms)


POOL = PoolSettings(
    SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=4),
    LimitsSettings(max_output_tokens=64),
    "test",
)
EXECUTOR = SimExecutorConfig(num_blocks=32, block_size=2, host_snapshot_blocks=8, vocab_size=64)


def _prompt(i: int) -> list[int]:
    return [(i * 7 + k) % 60 + 1 for k in range(3 + i % 4)]


def test_records_map_onto_steps_like_a_workload_file() -> None:
    t0 = 1_700_000_000_000
    records = [
        _record(i, t0 + 25 * i, {"request_id": f"r{i}", "prompt": _prompt(i), "max_tokens": 5})
        for i in range(6)
    ]
    records += [
        _record(6, t0 + 1, b"\xff"),
        _record(7, t0 + 2, {"request_id": "r0", "prompt": [1], "max_tokens": 2}),
        _record(8, t0 + 3, {"request_id": "big", "prompt": [1], "max_tokens": 65}),
        _record(9, t0 + 4, {"request_id": "t", "prompt": "text", "max_tokens": 2}),
    ]
    replay = build_workload(records, POOL, EXECUTOR, step_ms=50, tokenizer=None)
    assert replay.rejections == {"malformed_json": 1, "duplicate": 1, "max_tokens_too_large": 1}
    assert replay.skipped_text == 1
    written = Workload(
        model=ModelSection(exit="hash", vocab_size=64),
        cache=CacheSection(num_blocks=32, block_size=2, host_snapshot_blocks=8),
        scheduler=POOL.scheduler,
        requests=[
            WorkloadRequest(
                id=f"r{i}", arrival_step=i // 2, prompt=_prompt(i), max_tokens=5, ignore_eos=False
            )
            for i in range(6)
        ],
        max_steps=100_000,
    )
    assert replay.workload == written
    assert run_replay(replay.workload).report.to_json() == simulate(written).to_json()


def _spans(decisions: list[tuple[int, StepDecisions]]) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for step_id, step in decisions:
        span = tracer.start_span(
            attr.ADMISSION_STEP_SPAN,
            attributes={attr.STEP_ID: step_id, attr.EXECUTOR_ID: "sim-0", **step.attributes()},
        )
        span.end()
    tracer.start_span(attr.STEP_SPAN, attributes={attr.STEP_ID: 0}).end()  # not compared
    return exporter


@pytest.mark.parametrize("form", ["otlp", "jsonl"])
def test_spans_files_compare_with_a_replay(tmp_path: Path, form: str) -> None:
    t0 = 1_700_000_000_000
    records = [
        _record(i, t0, {"request_id": f"r{i}", "prompt": _prompt(i), "max_tokens": 5})
        for i in range(5)
    ]
    workload = build_workload(records, POOL, EXECUTOR, step_ms=50, tokenizer=None).workload
    replayed = run_replay(workload).decisions
    assert len(replayed) > 3
    # A recording that differs from the replay at its fourth step, in what it decoded.
    third_id, third = replayed[3]
    changed = StepDecisions(third.admitted, third.prefilled, third.decoded[:-1], third.preempted)
    for recording, divergence_at in ((replayed, None), ([*replayed[:3], (third_id, changed)], 3)):
        spans = _spans(recording).get_finished_spans()
        path = tmp_path / f"spans.{form}"
        if form == "otlp":
            path.write_text(MessageToJson(encode_spans(spans), indent=None) + "\n")
        else:
            path.write_text("".join(json.dumps(span_record(s)) + "\n" for s in spans))
        recorded = load_recorded_steps(path)
        divergence = first_divergence(recorded, replayed)
        if divergence_at is None:
            assert divergence is None
            continue
        assert divergence is not None and divergence.index == divergence_at
        assert (divergence.field, divergence.step_id) == ("decoded", third_id)
        assert divergence.expected == list(changed.decoded)
        assert divergence.got == list(third.decoded)
    short = first_divergence(load_recorded_steps(path)[:2], replayed)
    assert short is not None and (short.index, short.field) == (2, "extra")


def test_a_spans_file_without_decisions_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    old = {"name": attr.ADMISSION_STEP_SPAN, "attributes": {attr.STEP_ID: 0}}
    path.write_text(json.dumps(old) + "\n")
    with pytest.raises(SpansFileError, match="did not record its decisions"):
        load_recorded_steps(path)
    path.write_text("{oops\n")
    with pytest.raises(SpansFileError, match=r"old\.jsonl:1: not JSON"):
        load_recorded_steps(path)


def test_text_prompts_replay_with_a_tokenizer(tmp_path: Path) -> None:
    codec = load_tokenizer(_word_tokenizer(tmp_path))
    body = {"request_id": "t", "prompt": "hello world", "max_tokens": 3}
    replay = build_workload([_record(0, 0, body)], POOL, EXECUTOR, step_ms=50, tokenizer=codec)
    assert replay.skipped_text == 0
    assert replay.workload.requests[0].prompt == codec.encode("hello world")


def test_text_is_rejected_when_the_service_had_no_tokenizer(tmp_path: Path) -> None:
    service = tmp_path / "service.yaml"
    service.write_text(yaml.safe_dump({"scheduler": {"max_num_seqs": 2}}))
    pool = load_pool_settings(service)
    assert not pool.service_tokenizes
    body = {"request_id": "t", "prompt": "hello world", "max_tokens": 3}
    replay = build_workload([_record(0, 0, body)], pool, EXECUTOR, step_ms=50, tokenizer=None)
    assert (replay.skipped_text, replay.rejections) == (0, {"text_without_tokenizer": 1})
