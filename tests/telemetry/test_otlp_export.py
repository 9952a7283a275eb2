"""A real ``kvgate admission-service`` (embedded broker, a ``kvgate sim-executor``) exports its
spans over OTLP to an in-process receiver, once per protocol the environment can choose: request
spans and ``kvgate.step.round_trip`` spans linked to them arrive with the resource attributes
from ``OTEL_RESOURCE_ATTRIBUTES``, the service name and the model name; the headers from
``OTEL_EXPORTER_OTLP_HEADERS`` reach the receiver."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.telemetry import attributes as attr
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.integration.admission_stack import (
    REPO,
    service_settings,
    start_service,
    start_sim_executor,
)
from tests.telemetry.otlp_receivers import Received, ReceivedSpan, grpc_receiver, http_receiver

pytestmark = pytest.mark.timeout(180)

MODEL = "llama-3.2-1b-test"
REQUESTS = 4
RESOURCE = "k8s.pod.name=admission-7f9c,k8s.namespace.name=serving,kvgate.pool=pool-a"


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


def _receiver(protocol: str) -> AbstractContextManager[tuple[str, Received]]:
    return grpc_receiver() if protocol == "grpc" else http_receiver()


def _requests(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == f"text_completion {MODEL}"]


def _complete(spans: list[ReceivedSpan]) -> bool:
    steps = [s for s in spans if s.name == attr.ADMISSION_STEP_SPAN]
    return len(_requests(spans)) >= REQUESTS and bool(steps)


@pytest.mark.parametrize(
    ("variable", "protocol"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    ],
)
def test_spans_reach_the_receiver_of_the_chosen_protocol(
    broker: EmbeddedBroker, tmp_path: Path, variable: str, protocol: str
) -> None:
    topics = Topics.unique("otlp")
    executor = start_sim_executor(tmp_path, "sim-0", num_blocks=64, block_size=4)
    with _receiver(protocol) as (endpoint, received):
        settings = service_settings(
            broker.bootstrap,
            topics,
            [executor],
            kafka={"partitions": 1, "exactly_once": "auto"},
            telemetry={"model_name": MODEL},
        )
        env = {
            "OTEL_SDK_DISABLED": "false",
            variable: protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=team-a",
            "OTEL_RESOURCE_ATTRIBUTES": RESOURCE,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        service = start_service(tmp_path, "admission", settings, env=env)
        try:
            bodies = [request_body(f"r{i}", prompt_len=5, max_tokens=3) for i in range(REQUESTS)]
            asyncio.run(produce(broker.bootstrap, topics.requests, bodies))
            asyncio.run(read_results(broker.bootstrap, topics.results, REQUESTS))
            spans = received.wait_for(
                _complete, timeout_s=60, what=f"request and step spans over {protocol}"
            )
        finally:
            service.process.stop()
            executor.process.stop()
    requests = _requests(spans)
    for span in spans:
        assert span.resource["service.name"] == "kvgate-admission"
        assert span.resource["k8s.pod.name"] == "admission-7f9c"
        assert span.resource["k8s.namespace.name"] == "serving"
        assert span.resource["kvgate.pool"] == "pool-a"
    for span in requests:
        assert span.attributes[attr.GEN_AI_REQUEST_MODEL] == MODEL
        assert span.attributes[attr.GEN_AI_RESPONSE_MODEL] == MODEL
    steps = [s for s in spans if s.name == attr.ADMISSION_STEP_SPAN]
    assert all(s.attributes[attr.GEN_AI_REQUEST_MODEL] == MODEL for s in steps)
    # Every request was served by some step, and the step span links to the request's span.
    request_ids = {(s.trace_id, s.span_id) for s in requests}
    linked = {link for step in steps for link in step.links}
    assert request_ids <= linked
    assert all(h.get("x-tenant") == "team-a" for h in received.headers)


def _admission(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "admission.yaml"
    config.write_text("kafka: {bootstrap_servers: '127.0.0.1:1'}\nexecutors: {token: t}\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvgate", "admission-service", "--config", str(config)],
        env=clean | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json': OTLP protocols are grpc, http/protobuf",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp,zipkin"},
            "OTEL_TRACES_EXPORTER names 'zipkin', which is not installed",
        ),
    ],
)
def test_an_unusable_exporter_setting_is_one_line_at_start(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    done = _admission(tmp_path, env)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(f"kvgate admission-service: {message}"), done.stderr
