"""``kvgate demo`` end to end, as CI runs it: a real broker (embedded), a real executor process
with a tiny model, the admission service; every request answered, spans and plot written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(400)


def _demo(tmp_path: Path, *args: str, columns: int) -> str:
    """Run ``kvgate demo ARGS`` in ``tmp_path`` without the caller's kvgate/OTel settings; its
    output, after checking it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    env |= {"PYTHONPATH": str(REPO), "COLUMNS": str(columns)}
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "demo", *args, "--out-dir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def test_demo_answers_every_request_and_writes_spans_and_plot(tmp_path: Path) -> None:
    output = _demo(tmp_path, "--tiny", "--requests", "12", columns=120)
    assert re.search(r"requests lost\s+│ 0 ", output), output
    # 12 completed; rejected: one too large for the cache, one record that is not JSON.
    assert re.search(r"requests completed\s+│ 12 / 14 ", output), output
    assert re.search(r"requests rejected\s+│ 2 ", output), output
    spans = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    requests = [s for s in spans if s["name"] == "text_completion kvgate"]
    producers = {s["span_id"]: s for s in spans if s["kind"] == "PRODUCER"}
    # The 14 records produced to Kafka, and one streamed request through the OpenAI gateway.
    assert len(requests) == 15
    assert re.search(r"through the OpenAI API at http://127\.0\.0\.1:\d+/v1 \(streamed\)", output)
    completed = [s for s in requests if s["attributes"]["kvgate.request.status"] == "completed"]
    assert len(completed) == 13
    from_kafka = [s for s in completed if s["parent_span_id"] in producers]
    # The 12 from `kvgate produce`'s spans and the gateway's one, from its own PRODUCER span.
    assert len(from_kafka) == 13
    [gateway_send] = [p for p in producers.values() if "gen_ai.request.model" in p["attributes"]]
    assert gateway_send["attributes"]["gen_ai.operation.name"] == "text_completion"  # --tiny
    for span in from_kafka:
        # Each request span continues its producer's trace (traceparent in the Kafka headers).
        assert span["parent_span_id"] in producers
        assert producers[span["parent_span_id"]]["trace_id"] == span["trace_id"]
        assert span["attributes"]["gen_ai.usage.output_tokens"] > 0
    steps = [s for s in spans if s["name"] == "kvgate.step.round_trip"]
    assert steps and all(s["links"] or not s["attributes"]["kvgate.step.admissions"] for s in steps)
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_default_demo_serves_smollm2_text_and_chat(tmp_path: Path) -> None:
    """Two requests (one plain text, one chat) through the packaged model, answered with text."""
    from kvgate.executor.packaged import INSTALL_HINT, packaged_gguf

    if packaged_gguf() is None:
        pytest.skip(
            f"the packaged SmolLM2 model is not installed (make setup does: {INSTALL_HINT})"
        )
    output = _demo(tmp_path, "--requests", "2", columns=160)
    assert re.search(r"requests completed\s+│ 2 / 4 ", output), output
    # demo-000 is "The capital of France is" (greedy), demo-001 the chat about the same.
    assert re.search(r"demo-000 .*The capital of France is .*Paris", output), output
    assert re.search(r"demo-001 .*\(chat\) What is the capital of .*Paris", output), output
    # And one chat through the gateway, streamed, greedy.
    assert re.search(r"what does a queue do\?' -> 'A queue is a data structure", output), output


def test_the_text_workload_mixes_chat_and_plain_prompts_of_three_priorities() -> None:
    from kvgate.local.demo_report import demo_text_workload
    from kvgate.protocol.records import InferenceRequest

    workload = demo_text_workload(12)
    requests = [InferenceRequest.model_validate_json(r.value) for r in workload[:12]]
    assert sum(r.messages is not None for r in requests) == 6
    assert all(isinstance(r.prompt, str) for r in requests if r.messages is None)
    assert {r.priority for r in requests} == {0, 1, 2}
    assert {r.sampling.temperature > 0 for r in requests} == {True, False}
    assert [r.request_id for r in workload[12:]] == ["demo-too-large", "demo-malformed"]
