"""Real processes for the batch tests on real Kafka: ``kvgate gateway`` serving /v1/files and
/v1/batches over an S3 store with the feeder left out (``--no-batch-feeder``), and
``kvgate batch-feeder`` processes that can be killed and started again, as the chart runs them.
Every name (topics, group, store prefix) is unique to the test."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from tests.admission_service.kafka_helpers import Topics
from tests.harness.versitygw import REGION, S3Server
from tests.integration.admission_stack import (
    GATEWAY_KEY,
    Gateway,
    Process,
    free_port,
    spawn,
    start_gateway,
    wait_http,
)

TERMINAL = ("completed", "failed", "cancelled", "expired")


@dataclass(frozen=True)
class BatchNames:
    topics: Topics
    flags: tuple[str, ...]  # the batch flags every process of the test shares

    @classmethod
    def unique(
        cls, topics: Topics, s3: S3Server, credentials: Path, **limits: object
    ) -> BatchNames:
        base = f"b{uuid.uuid4().hex[:8]}"
        key_id, secret = s3.write_credentials(credentials)
        flags = [
            "--batch-store", "s3", "--batch-s3-endpoint", s3.endpoint,
            "--batch-s3-bucket", s3.bucket, "--batch-s3-prefix", base,
            "--batch-s3-region", REGION, "--batch-s3-access-key-id-file", str(key_id),
            "--batch-s3-secret-access-key-file", str(secret), "--batch-s3-allow-http",
            "--batch-topic", f"{base}.batches", "--batch-files-topic", f"{base}.files",
            "--batch-reply-topic", f"kvgate.replies.{base}-batches",
            "--batch-feeder-group", f"{base}-feeders", "--batch-partitions", "3",
            "--batch-session-timeout-ms", "6000", "--batch-heartbeat-interval-ms", "1000",
        ]  # fmt: skip
        for name, value in limits.items():
            flags += [f"--batch-{name.replace('_', '-')}", str(value)]
        return cls(topics, tuple(flags))


@dataclass
class Feeder:
    process: Process
    health_port: int


def start_batch_gateway(log_dir: Path, bootstrap: str, names: BatchNames) -> Gateway:
    return start_gateway(
        log_dir, bootstrap, names.topics, f"gw-{uuid.uuid4().hex[:6]}",
        extra=(*names.flags, "--no-batch-feeder"),
    )  # fmt: skip


def start_feeder(log_dir: Path, bootstrap: str, names: BatchNames, name: str) -> Feeder:
    port = free_port()
    topics = names.topics
    argv = [
        "batch-feeder", "--bootstrap", bootstrap, "--replica-id", name, "--model", "sim",
        "--request-topic", topics.requests, "--result-topic", topics.results,
        "--abort-topic", topics.aborts, "--health-port", str(port), *names.flags,
    ]  # fmt: skip
    process = spawn(name, argv, log_dir)
    wait_http(process, f"http://127.0.0.1:{port}/readyz")
    return Feeder(process, port)


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=GATEWAY_KEY, max_retries=0
    )


def completion_line(i: int, *, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"line-{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": "sim",
            "prompt": [1 + i % 40, 2, 3, 4],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **body,
        },
    }


def jsonl(lines: list[dict[str, Any] | bytes]) -> io.BytesIO:
    data = b"".join(
        line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n" for line in lines
    )
    return io.BytesIO(data)


def wait_batch(
    api: openai.OpenAI,
    batch_id: str,
    until: Callable[[Any], bool] = lambda b: b.status in TERMINAL,
    *,
    timeout_s: float = 120.0,
) -> Any:
    """Poll the batch until ``until`` holds for it (a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if until(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} never got there: {batch}")
        time.sleep(0.2)


def file_lines(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.files.content(file_id).text.splitlines()]


def feeder_ready(feeder: Feeder) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{feeder.health_port}/readyz", timeout=2
        ) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False
