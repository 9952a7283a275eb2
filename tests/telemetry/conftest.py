"""Fixtures of the telemetry tests.

The broker fixtures are the integration tier's (``tests/integration/conftest.py``): the tests
against a real collector and a real Prometheus run a real stack on real Kafka. Fixtures are per
directory, so run together with ``tests/integration`` this package gets a broker of its own (as
``tests/reliability`` does). The other tests here use the embedded broker and need neither
Docker nor Go.
"""

from __future__ import annotations

from tests.integration.conftest import (  # noqa: F401 — fixtures used by name
    harness_docker_engine,
    kafka_broker,
)
