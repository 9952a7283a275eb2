"""Security check: the service's Kafka TLS settings reach its clients.

The session broker has a TLS listener with a certificate made for this session. An admission
service configured with ``security_protocol: SSL`` and that certificate as its CA consumes,
answers and commits over TLS only (the test's own clients use the plaintext listener); the same
client options without the CA (the system trust store) are refused by the handshake.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from kvgate.admission_service.kafka_io import client_options
from kvgate.admission_service.settings import KafkaSettings
from kvgate.sim.backend import SimExecutorConfig
from tests.harness.kafka import KafkaBroker, TlsEndpoint
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
