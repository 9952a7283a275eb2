"""The Batch API end to end with the official ``openai`` client, on real Kafka (transactions
on) and a real S3 server (versitygw): ``kvgate gateway`` (files and batches over HTTP),
``kvgate batch-feeder`` processes, ``kvgate admission-service`` and ``kvgate sim-executor``.

Each scenario checks what a client sees (statuses, counts, the output and error files) and
what the service did (every line's request id answered exactly once in the results topic).
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvgate.batch.ids import parse_line_request_id
from tests.admission_service.kafka_helpers import Topics, read_results
from tests.batch.conftest import s3_server  # noqa: F401 — the fixture, used by name
from tests.harness.kafka import KafkaBroker
from tests.harness.versitygw import S3Server
from tests.integration.admission_stack import (
    service_settings,
    start_service,
    start_sim_executor,
)
from tests.integration.batch_stack import (
    BatchNames,
    client,
    completion_line,
    file_lines,
    jsonl,
    start_batch_gateway,
    start_feeder,
    wait_batch,
)

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.timeout(300, func_only=True)]


def _results_per_line(bootstrap: str, topics: Topics, batch_id: str, count: int) -> Counter[int]:
    """How many results the service wrote for each line of the batch (settled: late copies
    would show)."""
    results = asyncio.run(read_results(bootstrap, topics.results, count, settle_s=1.0))
    per_line: Counter[int] = Counter()
    for result in results:
        parsed = parse_line_request_id(result.request_id)
        if parsed is not None and parsed[0] == batch_id:
            per_line[parsed[1]] += 1
    return per_line


@pytest.fixture
def stack(
    kafka_broker: KafkaBroker, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, object]]:
    s3: S3Server = request.getfixturevalue("s3_server")
    topics = Topics.unique("batches")
    executor = start_sim_executor(tmp_path, "exec-a", num_blocks=256, block_size=4, step_time_ms=5)
    settings = service_settings(kafka_broker.bootstrap, topics, [executor])
    settings["kafka"]["exactly_once"] = "on"
    service = start_service(tmp_path, "service", settings)
    names = BatchNames.unique(
        topics, s3, tmp_path / "s3", max_file_lines=300, segment_lines=10,
        abort_grace_s=10,
    )  # fmt: skip
    gateway = start_batch_gateway(tmp_path, kafka_broker.bootstrap, names)
    parts = {"names": names, "gateway": gateway, "service": service, "executor": executor}
    yield parts
    for part in ("gateway", "service", "executor"):
        parts[part].process.stop()  # type: ignore[attr-defined]


def test_a_batch_through_the_openai_client_with_malformed_lines(
    kafka_broker: KafkaBroker, stack: dict[str, object], tmp_path: Path
) -> None:
    names: BatchNames = stack["names"]  # type: ignore[assignment]
    feeder = start_feeder(tmp_path, kafka_broker.bootstrap, names, "feeder-a")
    api = client(stack["gateway"])  # type: ignore[arg-type]
    try:
        lines: list[dict | bytes] = [completion_line(i) for i in range(30)]
        lines[3:3] = [b"{not json\n"]
        lines[7:7] = [completion_line(100) | {"url": "/v1/embeddings"}]
        lines[9:9] = [completion_line(101, temperature=5)]  # the door refuses it
        lines[12:12] = [completion_line(102, model="nobody")]
        uploaded = api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.status == "processed"
        assert api.files.retrieve(uploaded.id).bytes == uploaded.bytes
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
            metadata={"run": "integration"},
        )  # fmt: skip
        assert batch.status == "validating" and batch.metadata == {"run": "integration"}
        with pytest.raises(openai.BadRequestError, match="has not finished"):
            api.files.delete(uploaded.id)  # the input of a running batch stays
        done = wait_batch(api, batch.id)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": 34, "completed": 30, "failed": 4}
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        output = file_lines(api, done.output_file_id)
        errors = file_lines(api, done.error_file_id)
        assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(30)]
        assert all(o["response"]["status_code"] == 200 for o in output)
        assert output[5]["response"]["body"]["usage"]["completion_tokens"] == 4
        assert [e["custom_id"] for e in errors] == [None, "line-100", "line-101", "line-102"]
        assert [e["error"]["code"] for e in errors[:2]] == ["invalid_json", "invalid_url"]
        assert [e["response"]["status_code"] for e in errors[2:]] == [400, 404]
        assert done.usage.output_tokens == 30 * 4
        with pytest.raises(openai.BadRequestError, match="nothing to cancel"):
            api.batches.cancel(batch.id)
        per_line = _results_per_line(kafka_broker.bootstrap, names.topics, batch.id, 30)
        assert sorted(per_line.values()) == [1] * 30  # each sent line answered exactly once
        assert [b.id for b in api.batches.list(limit=1)] == [batch.id]
        kinds = {f.id: f.purpose for f in api.files.list()}
        assert kinds == {
            uploaded.id: "batch", done.output_file_id: "batch_output",
            done.error_file_id: "batch_output",
        }  # fmt: skip
        assert api.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(uploaded.id)
        # Over the limits: a 400 at upload, and nothing kept.
        too_many = jsonl([completion_line(i) for i in range(301)])
        with pytest.raises(openai.BadRequestError, match="more than 300 lines"):
            api.files.create(file=("big.jsonl", too_many), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            api.files.create(file=("x.jsonl", jsonl([completion_line(0)])), purpose="assistants")
        assert {f.id for f in api.files.list()} == {done.output_file_id, done.error_file_id}
    finally:
        feeder.process.stop()


def test_a_feeder_killed_mid_batch_is_replaced_and_every_line_is_answered_exactly_once(
    kafka_broker: KafkaBroker, stack: dict[str, object], tmp_path: Path
) -> None:
    names: BatchNames = stack["names"]  # type: ignore[assignment]
    first = start_feeder(tmp_path, kafka_broker.bootstrap, names, "feeder-a")
    api = client(stack["gateway"])  # type: ignore[arg-type]
    second = None
    try:
        lines = [completion_line(i, max_tokens=12) for i in range(200)]
        uploaded = api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_batch(api, batch.id, lambda b: b.request_counts.completed >= 40)
        first.process.popen.send_signal(signal.SIGKILL)  # mid-batch, lines in flight
        first.process.wait(30)
        second = start_feeder(tmp_path, kafka_broker.bootstrap, names, "feeder-b")
        done = wait_batch(api, batch.id, timeout_s=180)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
        output = file_lines(api, done.output_file_id)
        assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(200)]
        per_line = _results_per_line(kafka_broker.bootstrap, names.topics, batch.id, 200)
        assert sorted(per_line) == list(range(200))
        assert sorted(per_line.values()) == [1] * 200  # nothing ran twice
    finally:
        first.process.stop()
        if second is not None:
            second.process.stop()


def test_a_cancel_mid_batch_aborts_what_runs_and_finalizes_the_files(
    kafka_broker: KafkaBroker, stack: dict[str, object], tmp_path: Path
) -> None:
    names: BatchNames = stack["names"]  # type: ignore[assignment]
    feeder = start_feeder(tmp_path, kafka_broker.bootstrap, names, "feeder-a")
    api = client(stack["gateway"])  # type: ignore[arg-type]
    try:
        lines = [completion_line(i, max_tokens=40) for i in range(150)]
        uploaded = api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_batch(api, batch.id, lambda b: b.request_counts.completed >= 10)
        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        done = wait_batch(api, batch.id)
        assert done.status == "cancelled", done
        counts = done.request_counts
        assert counts.total == 150 and counts.completed + counts.failed == 150
        assert 10 <= counts.completed < 150
        output = file_lines(api, done.output_file_id)
        errors = file_lines(api, done.error_file_id)
        answered = [o["custom_id"] for o in output] + [e["custom_id"] for e in errors]
        assert sorted(answered) == sorted(f"line-{i}" for i in range(150))  # each line once
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert api.batches.cancel(batch.id).status == "cancelled"  # again: as it is
    finally:
        feeder.process.stop()
