"""``kvgate replay`` against real Kafka, as real processes.

1. A workload file is produced onto a three-partition topic (record timestamps at its arrival
   steps × the step time, a few bad and text records among them, older records before the
   window); replaying it from an offset and from a time must give the report of
   ``kvgate sim`` on the workload file itself — an independent path that never reads Kafka.
2. A real ``kvgate admission-service`` with a ``kvgate sim-executor`` runs requests with its
   spans written to a file; replaying the log with the service's settings file must match every
   recorded step, and with a smaller ``max_num_seqs`` it must name step 0 and what differs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiokafka import AIOKafkaProducer

from kvgate.scheduler.config import Mode, SchedulerConfig
from kvgate.sim.workload import CacheSection, ExitMode, ModelSection, Workload, WorkloadRequest
from kvgate.telemetry import attributes as attr
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.harness.kafka import KafkaBroker
from tests.harness.kafka_client import TopicFactory
from tests.integration.admission_stack import (
    REPO,
    service_settings,
    start_service,
    start_sim_executor,
)

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180, func_only=True)]

STEP_MS = 100
EXECUTOR = {"num_blocks": 24, "block_size": 4, "host_snapshot_blocks": 12, "vocab_size": 512}
WIDE = EXECUTOR | {"num_blocks": 96}  # room for the first step to fill every slot
MAX_STEPS = 2000


def _workload() -> Workload:
    """Twelve requests in a staggered burst onto a cache that holds a few: preemption happens."""
    requests = []
    for i in range(12):
        prompt = [(i * 37 + 11 * k) % 500 + 1 for k in range(5 + (i * 7) % 11)]
        requests.append(
            WorkloadRequest(
                id=f"w{i:02d}",
                arrival_step=(i // 3) * 2,
                prompt=prompt,
                max_tokens=6 + (i * 5) % 9,
                priority=(i * 2) % 3,
                seed=i,
            )
        )
    return Workload(
        model=ModelSection(exit=ExitMode.HASH, vocab_size=EXECUTOR["vocab_size"]),
        cache=CacheSection(
            num_blocks=EXECUTOR["num_blocks"],
            block_size=EXECUTOR["block_size"],
            host_snapshot_blocks=EXECUTOR["host_snapshot_blocks"],
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            prefill_chunk_size=8,
            mode=Mode.MIXED,
            async_scheduling=True,
        ),
        requests=requests,
        max_steps=MAX_STEPS,
    )


def _body(request: WorkloadRequest) -> dict[str, Any]:
    return {
        "request_id": request.id,
        "prompt": list(request.prompt or []),
        "max_tokens": request.max_tokens,
        "priority": request.priority,
        "sampling": {"seed": request.seed, "ignore_eos": request.ignore_eos},
    }


async def _produce_at(bootstrap: str, topic: str, records: list[tuple[int, int, bytes]]) -> None:
    """(partition, timestamp ms, value) each, in order."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for partition, timestamp_ms, value in records:
            await producer.send_and_wait(
                topic, value, partition=partition, timestamp_ms=timestamp_ms
            )
    finally:
        await producer.stop()


def _kvgate(*argv: str | Path, expect: int | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", *map(str, argv)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if expect is not None:
        assert done.returncode == expect, done.stderr + done.stdout[-2000:]
    return done


def _executor_flags(executor: dict[str, int]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in executor.items()]


def test_replay_from_offset_and_time_equals_sim_of_the_workload_file(
    kafka_broker: KafkaBroker, topic_factory: TopicFactory, tmp_path: Path
) -> None:
    workload = _workload()
    workload_file = tmp_path / "workload.json"
    workload_file.write_text(workload.model_dump_json())
    settings_file = tmp_path / "pool.yaml"
    settings_file.write_text(
        yaml.safe_dump({"scheduler": workload.scheduler.model_dump(mode="json")})
    )
    topic = topic_factory(partitions=3)
    base_ms = int(time.time() * 1000) - 60_000
    # Before the window: one record on every partition, ten seconds earlier.
    before = [
        (p, base_ms - 10_000 + p, json.dumps(request_body(f"old{p}")).encode()) for p in range(3)
    ]
    window: list[tuple[int, int, bytes]] = []
    for index, request in enumerate(workload.requests):
        at = base_ms + request.arrival_step * STEP_MS + index  # within its step, in file order
        window.append((index % 3, at, json.dumps(_body(request)).encode()))
    window += [
        (0, base_ms + 1, b"{not json"),
        (1, base_ms + 2, json.dumps({"request_id": "bad", "max_tokens": 0}).encode()),
        (2, base_ms + 3, json.dumps({"request_id": "text", "prompt": "hello"}).encode()),
    ]
    asyncio.run(_produce_at(kafka_broker.bootstrap, topic, before + window))

    expected = json.loads(_kvgate("sim", workload_file, "--json", expect=0).stdout)
    common = [
        "replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic,
        "--config", settings_file, "--step-ms", str(STEP_MS), "--max-steps", str(MAX_STEPS),
        *_executor_flags(EXECUTOR),
    ]  # fmt: skip
    since = datetime.fromtimestamp(base_ms / 1000, tz=UTC).isoformat()
    for start in ("1", since):
        out = tmp_path / "report.json"
        _kvgate(*common, "--from", start, "--out", out, expect=0)
        report = json.loads(out.read_text())
        assert report["sim"] == expected, start
        assert report["records"] == len(window)
        assert report["replayed"] == len(workload.requests)
        # The settings name no tokenizer: that service refused text, and so does its replay.
        assert report["rejected_records"] == {
            "malformed_json": 1,
            "schema": 1,
            "text_without_tokenizer": 1,
        }
        assert report["skipped_text_prompts"] == 0
    assert expected["preemptions"] > 0, "the workload should exercise preemption"
    # --to ends the window: only the first two steps' requests.
    until = datetime.fromtimestamp((base_ms + 2 * STEP_MS) / 1000, tz=UTC).isoformat()
    out = tmp_path / "early.json"
    _kvgate(*common, "--from", since, "--to", until, "--out", out, expect=0)
    assert json.loads(out.read_text())["replayed"] == 3


def _recorded_steps(spans_file: Path) -> list[dict[str, Any]]:
    """The service's step spans straight from its spans file (independent of the replay)."""
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line]
    steps = [s["attributes"] for s in spans if s["name"] == attr.ADMISSION_STEP_SPAN]
    return sorted(steps, key=lambda a: a[attr.STEP_ID])


def test_spans_of_a_service_run_match_and_a_setting_change_diverges(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    topics = Topics.unique("replay")
    bodies = [
        request_body(f"s{i}", prompt_len=6 + (i * 5) % 9, max_tokens=5 + i % 4, priority=i % 2)
        for i in range(8)
    ]
    executor = start_sim_executor(tmp_path, "sim-0", **WIDE)
    spans_file = tmp_path / "spans.jsonl"
    scheduler = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "async_scheduling": False}
    settings = service_settings(
        kafka_broker.bootstrap,
        topics,
        [executor],
        kafka={"partitions": 1},
        scheduler=scheduler,
        telemetry={"spans_file": str(spans_file)},
    )
    service = start_service(tmp_path, "admission", settings, env={"OTEL_SDK_DISABLED": "false"})
    try:
        asyncio.run(produce(kafka_broker.bootstrap, topics.requests, bodies))
        asyncio.run(read_results(kafka_broker.bootstrap, topics.results, len(bodies)))
    finally:
        service.process.stop()  # flushes the spans
        executor.process.stop()
    recorded = _recorded_steps(spans_file)
    assert recorded and len(recorded[0][attr.STEP_ADMITTED_IDS]) == 4

    common = [
        "replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topics.requests,
        "--from", "0", "--spans", spans_file, "--step-ms", "60000", *_executor_flags(WIDE),
    ]  # fmt: skip
    matched = _kvgate(*common, "--config", service.config_path, expect=0)
    spans = json.loads(matched.stdout)["spans"]
    assert spans == {
        "recorded_steps": len(recorded),
        "replayed_steps": len(recorded),
        "matched": True,
        "first_divergence": None,
    }

    narrower = tmp_path / "narrower.yaml"
    narrower.write_text(yaml.safe_dump(settings | {"scheduler": scheduler | {"max_num_seqs": 3}}))
    diverged = _kvgate(*common, "--config", narrower, expect=1)
    divergence = json.loads(diverged.stdout)["spans"]["first_divergence"]
    first = recorded[0]
    assert divergence == {
        "index": 0,
        "step_id": first[attr.STEP_ID],
        "field": "admitted",
        "expected": first[attr.STEP_ADMITTED_IDS],
        "got": first[attr.STEP_ADMITTED_IDS][:3],
    }
    assert f"step {first[attr.STEP_ID]} (index 0) differs in admitted" in diverged.stderr
