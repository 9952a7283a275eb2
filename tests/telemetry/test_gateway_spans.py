"""A real ``kvgate gateway`` on the embedded broker traces each request it writes to Kafka: a
PRODUCER span reaches an OTLP/gRPC receiver with the gateway's service name, the resource
attributes and the model name clients asked for, and the Kafka record carries that span's
context in its ``traceparent`` header (the admission service continues it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import TRACEPARENT_HEADER
from kvgate.telemetry import attributes as attr
from tests.admission_service.kafka_helpers import read_all
from tests.integration.admission_stack import REPO, free_port
from tests.telemetry.otlp_receivers import grpc_receiver

pytestmark = pytest.mark.timeout(120)

MODEL = "llama-3.2-1b-test"


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


async def _create_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()


def _ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the gateway exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway is not ready: {log.read_text()[-3000:]}")
        time.sleep(0.1)


def test_the_gateway_traces_what_it_writes_to_kafka(broker: EmbeddedBroker, tmp_path: Path) -> None:
    topic = f"t{os.getpid()}-gw.requests"
    asyncio.run(_create_topic(broker.bootstrap, topic))
    port, health_port = free_port(), free_port()
    with grpc_receiver() as (endpoint, received):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
        env |= {
            "PYTHONPATH": str(REPO),
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=gateway-0,k8s.namespace.name=serving",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        log = tmp_path / "gateway.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvgate", "gateway", "--bootstrap", broker.bootstrap,
                 "--port", str(port), "--health-port", str(health_port), "--model", MODEL,
                 "--request-topic", topic, "--allow-anonymous", "--request-timeout-s", "1"],
                env=env, stdout=sink, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _ready(f"http://127.0.0.1:{health_port}/readyz", process, log)
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "request_id": "gw-t1"}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as unanswered:  # no admission service
                urllib.request.urlopen(request, timeout=30)
            assert unanswered.value.code == 504
            [record] = asyncio.run(read_all(broker.bootstrap, topic, until_count=1))
            spans = received.wait_for(
                lambda spans: any(s.name == f"send {topic}" for s in spans),
                timeout_s=30,
                what="the gateway's producer span",
            )
        finally:
            process.terminate()
            process.wait(timeout=30)
    [span] = [s for s in spans if s.name == f"send {topic}"]
    assert span.resource["service.name"] == "kvgate-gateway"
    assert span.resource["k8s.pod.name"] == "gateway-0"
    assert span.resource["k8s.namespace.name"] == "serving"
    assert span.attributes[attr.GEN_AI_REQUEST_MODEL] == MODEL
    # The record's id: the client's key scoped to its tenant ("gw-t1@<digest>").
    request_id = json.loads(record.value)["request_id"]
    assert request_id.startswith("gw-t1@")
    assert span.attributes[attr.GEN_AI_RESPONSE_ID] == request_id
    headers = dict(record.headers)
    _, trace_id, span_id, _ = headers[TRACEPARENT_HEADER].decode().split("-")
    assert (trace_id, span_id) == (span.trace_id, span.span_id)
