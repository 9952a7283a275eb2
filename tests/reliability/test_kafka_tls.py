"""Security check: the service's and the gateway's Kafka TLS settings reach their clients.

The session broker has a TLS listener with a certificate made for this session. An admission
service configured with ``security_protocol: SSL`` and that certificate as its CA consumes,
answers and commits over TLS only (the test's own clients use the plaintext listener); the same
client options without the CA (the system trust store) are refused by the handshake. A
``kvgate gateway`` with ``--kafka-security-protocol SSL`` and the CA answers OpenAI requests end
to end with every Kafka connection (its own and the service's) on the TLS listener; without the
CA it exits at start with one line naming the broker, and no traceback.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from kvgate.admission_service.settings import KafkaSettings
from kvgate.kafka_connection import client_options
from kvgate.sim.backend import SimExecutorConfig
from tests.admission_service.kafka_helpers import Topics
from tests.harness.kafka import KafkaBroker, TlsEndpoint
from tests.integration.admission_stack import (
    GATEWAY_KEY,
    Service,
    SimExecutor,
    service_settings,
    spawn,
    start_gateway,
    start_service,
    start_sim_executor,
)
from tests.reliability.cluster import Cluster
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(240, func_only=True)

GEOMETRY = {"num_blocks": 256, "block_size": 8}


def _tls_endpoint(broker: KafkaBroker) -> TlsEndpoint:
    if broker.tls is None:
        pytest.skip("the broker has no TLS listener (KAFKA_BOOTSTRAP points at an external one)")
    return broker.tls


async def test_service_runs_over_the_tls_listener(
    cluster: Cluster, kafka_broker: KafkaBroker
) -> None:
    endpoint = _tls_endpoint(kafka_broker)
    bodies = mixed_bodies(24, "t", vocab_size=512)
    reference = sim_reference(bodies, SimExecutorConfig(**GEOMETRY))
    executors = cluster.sim_executors("exec-a", **GEOMETRY)
    tls = {
        "bootstrap_servers": endpoint.bootstrap,
        "security_protocol": "SSL",
        "ssl_cafile": str(endpoint.ca_file),
    }
    service = cluster.service("service", cluster.settings(executors, kafka=tls))
    await cluster.send_requests(bodies)
    summary = await cluster.verify(reference, [service], executors)
    assert summary.completed == len(bodies)


async def test_an_untrusted_broker_certificate_is_refused(kafka_broker: KafkaBroker) -> None:
    endpoint = _tls_endpoint(kafka_broker)
    base = {"bootstrap_servers": endpoint.bootstrap, "request_timeout_ms": 3000}
    trusted = KafkaSettings.model_validate(
        base | {"security_protocol": "SSL", "ssl_cafile": str(endpoint.ca_file)}
    )
    producer = AIOKafkaProducer(**client_options(trusted))
    await producer.start()
    await producer.stop()

    untrusting = KafkaSettings.model_validate(base | {"security_protocol": "SSL"})
    producer = AIOKafkaProducer(**client_options(untrusting))
    with pytest.raises(KafkaError):
        await producer.start()
    await producer.stop()


def _tls_stack(endpoint: TlsEndpoint, log_dir: Path) -> tuple[Topics, SimExecutor, Service]:
    """A sim executor and an admission service that reaches Kafka over TLS only."""
    topics = Topics.unique("gateway-tls")
    executor = start_sim_executor(log_dir, "exec-a", num_blocks=64, block_size=4)
    tls = {"security_protocol": "SSL", "ssl_cafile": str(endpoint.ca_file)}
    settings = service_settings(endpoint.bootstrap, topics, [executor], kafka=tls)
    return topics, executor, start_service(log_dir, "service", settings)


async def test_gateway_answers_openai_requests_over_the_tls_listener(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    endpoint = _tls_endpoint(kafka_broker)
    flags = ("--kafka-security-protocol", "SSL", "--kafka-ssl-cafile", str(endpoint.ca_file))
    topics, executor, service = _tls_stack(endpoint, tmp_path)
    gateway = start_gateway(tmp_path, endpoint.bootstrap, topics, "tls-gw", extra=flags)
    try:
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=GATEWAY_KEY, max_retries=0
        )
        async with api:
            done = await api.completions.create(
                model="sim", prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True}
            )
            chunks = await api.completions.create(
                model="sim",
                prompt=[5, 6, 7],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            streamed = [c.usage.completion_tokens async for c in chunks if c.usage is not None]
        assert done.usage is not None and done.usage.completion_tokens == 5
        assert streamed == [4]
        log = gateway.process.log_tail(20_000)
        assert f"Kafka at {endpoint.bootstrap} (SSL, CA {endpoint.ca_file})" in log, log
        assert "Traceback" not in log, log
    finally:
        for process in (gateway.process, service.process, executor.process):
            process.stop()


def test_gateway_refuses_an_untrusted_broker_certificate_at_start(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """No CA given: the system trust store does not know the session's certificate. The
    gateway must not hang or serve: it exits 1 within the deadline, saying why in one line."""
    endpoint = _tls_endpoint(kafka_broker)
    keys = tmp_path / "keys.yaml"
    keys.write_text('{"keys": [{"name": "k", "key": "sk-untrusted-0123456789"}]}')
    began = time.monotonic()
    process = spawn(
        "untrusting-gw",
        [
            "gateway",
            "--bootstrap",
            endpoint.bootstrap,
            "--port",
            "0",
            "--replica-id",
            "untrusting",
            "--api-keys-file",
            str(keys),
            "--kafka-security-protocol",
            "SSL",
        ],
        tmp_path,
    )
    assert process.wait(timeout_s=60) == 1
    assert time.monotonic() - began < 60
    log = process.log_tail(20_000)
    assert (
        f"kvgate gateway: cannot use Kafka at {endpoint.bootstrap} (SSL, CA system trust store)"
        in log
    ), log
    assert "certificate verify failed" in log.lower(), log
    assert "Traceback" not in log, log
