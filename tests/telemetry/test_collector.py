"""kvgate's spans through a real OpenTelemetry Collector (built from Go modules,
``tests/harness/otelcol.py``), read back from what the collector itself exported.

A real stack against real Kafka: ``kvgate admission-service`` and a ``kvgate executor`` serving a
tiny checkpoint on the CPU, both exporting to the collector over the protocol
``OTEL_EXPORTER_OTLP_PROTOCOL`` names (gRPC in one run, HTTP in the other). Their ``OTEL_*``
variables are the ones the operator gives a pool's pods (``telemetry_env``), filled in as the
kubelet fills them (Downward API fields, then ``$(VAR)`` references). The test reads the
collector's file exporter: request spans, the admission service's ``kvgate.step.round_trip``
spans linked to them, and the executor's per-step ``kvgate.step`` spans, children of those round
trips and linked to the requests they served — each with its pod, namespace and pool as resource
attributes and the served model's name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.operator.builders.common import PoolRef, telemetry_env
from kvgate.operator.models import OtlpProtocol, TelemetrySpec
from kvgate.operator.naming import COMPONENT_ADMISSION, COMPONENT_EXECUTOR
from kvgate.protocol.records import ResultStatus
from kvgate.telemetry import attributes as attr
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.harness.kafka import KafkaBroker
from tests.harness.otelcol import Collector
from tests.integration.admission_stack import service_settings, start_service
from tests.reliability.processes import spawn_real_executor, wait_executor_ready
from tests.telemetry.otlp_receivers import ReceivedSpan

pytestmark = [
    pytest.mark.observability,
    pytest.mark.kafka,
    pytest.mark.docker,
    pytest.mark.timeout(300),
]

POOL = PoolRef(name="pool-a", namespace="serving", uid="0000-pool-a")
EXECUTOR_POD = "pool-a-executor-0"
ADMISSION_POD = "pool-a-admission-6d4f9-x2k8q"
REQUESTS = 3
VOCAB = 128  # the tiny checkpoint's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
    from kvgate.protocol.enums import ModelFamily

    spec = TinyModelSpec(family=ModelFamily.LLAMA, vocab_size=VOCAB, seed=4)
    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


@pytest.fixture
def collector(collector_binary: Path) -> Iterator[Collector]:
    with Collector(collector_binary) as running:
        yield running


def pod_environment(component: str, pod: str, endpoint: str, protocol: str) -> dict[str, str]:
    """The ``OTEL_*`` variables the operator gives a pool pod, as its kubelet would set them."""
    telemetry = TelemetrySpec(otlp_endpoint=endpoint, otlp_protocol=OtlpProtocol(protocol))
    fields = {"metadata.name": pod, "metadata.namespace": POOL.namespace}
    env: dict[str, str] = {}
    for entry in telemetry_env(POOL, telemetry, component):
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            continue
        value = entry["value"]
        for name, known in env.items():  # only variables defined earlier expand
            value = value.replace(f"$({name})", known)
        env[entry["name"]] = value
    # Test-only: export each batch within 100 ms instead of 5 s, and turn the SDK on (the
    # stack's processes start with it off).
    return env | {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SDK_DISABLED": "false"}


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_request_round_trip_and_step_spans_reach_the_collector(
    kafka_broker: KafkaBroker,
    collector: Collector,
    model_dir: Path,
    tmp_path: Path,
    protocol: str,
) -> None:
    model = str(model_dir)  # what the operator passes as --model and telemetry.model_name
    request_span = f"text_completion {model}"
    endpoint = collector.endpoint(protocol)
    executor = spawn_real_executor(
        tmp_path, "executor-0", model_dir, num_blocks=64, block_size=4,
        env=pod_environment(COMPONENT_EXECUTOR, EXECUTOR_POD, endpoint, protocol),
    )  # fmt: skip
    service = None
    try:
        wait_executor_ready(executor)
        topics = Topics.unique("otelcol")
        settings = service_settings(
            kafka_broker.bootstrap,
            topics,
            [executor],
            kafka={"partitions": 1},
            telemetry={"model_name": model},
        )
        service = start_service(
            tmp_path,
            "admission",
            settings,
            env=pod_environment(COMPONENT_ADMISSION, ADMISSION_POD, endpoint, protocol),
        )
        bodies = [
            request_body(f"r{i}", prompt=[(7 * i + k) % (VOCAB - 1) + 1 for k in range(6)])
            for i in range(REQUESTS)
        ]
        asyncio.run(produce(kafka_broker.bootstrap, topics.requests, bodies))
        results = asyncio.run(read_results(kafka_broker.bootstrap, topics.results, REQUESTS))
        assert all(r.status is ResultStatus.COMPLETED for r in results), results

        def complete(spans: list[ReceivedSpan]) -> bool:
            # Every request served, and every step span seen so far with its round trip: the
            # two processes export on their own schedules, so a step's span may arrive first.
            steps = _named(spans, attr.STEP_SPAN)
            served = {link for s in steps for link in s.links}
            requests = {(s.trace_id, s.span_id) for s in _named(spans, request_span)}
            trips = {(s.trace_id, s.span_id) for s in _named(spans, attr.ADMISSION_STEP_SPAN)}
            parented = all((s.trace_id, s.parent_span_id or "") in trips for s in steps)
            return len(requests) == REQUESTS and requests <= served and parented

        spans = collector.wait_for_spans(
            complete, timeout_s=60, what=f"request and step spans over {protocol}"
        )
    finally:
        if service is not None:
            service.process.stop()
        executor.process.stop()

    requests = _named(spans, request_span)
    round_trips = _named(spans, attr.ADMISSION_STEP_SPAN)
    steps = _named(spans, attr.STEP_SPAN)
    request_ids = {(s.trace_id, s.span_id) for s in requests}
    # Resource attributes: the pod, its namespace and the pool, as the operator sets them.
    for span, pod, service_name in [
        *((s, ADMISSION_POD, "kvgate-admission") for s in requests + round_trips),
        *((s, EXECUTOR_POD, "kvgate-executor") for s in steps),
    ]:
        assert span.resource["service.name"] == service_name, span
        assert span.resource["k8s.pod.name"] == pod, span
        assert span.resource["k8s.namespace.name"] == "serving", span
        assert span.resource["kvgate.pool"] == "pool-a", span
    # The model's name on every span of the three kinds, never the "kvgate" default.
    for span in requests + round_trips + steps:
        assert span.attributes[attr.GEN_AI_REQUEST_MODEL] == model, span
    for span in requests:
        assert span.attributes[attr.GEN_AI_RESPONSE_MODEL] == model
    # Each executor step is the child of the admission service's round trip of the same step,
    # in its trace, and links to the requests it served; every request was served.
    by_id = {(s.trace_id, s.span_id): s for s in round_trips}
    for step in steps:
        parent = by_id.get((step.trace_id, step.parent_span_id or ""))
        assert parent is not None, f"kvgate.step {step.attributes} has no round-trip parent"
        assert parent.attributes[attr.STEP_ID] == step.attributes[attr.STEP_ID]
        assert set(step.links) <= request_ids | {link for r in round_trips for link in r.links}
    assert request_ids <= {link for s in steps for link in s.links}
    assert request_ids <= {link for s in round_trips for link in s.links}
