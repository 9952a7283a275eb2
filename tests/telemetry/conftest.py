"""Fixtures of the telemetry tests.

The broker fixtures are the integration tier's (``tests/integration/conftest.py``): the tests
against a real collector and a real Prometheus run a real stack on real Kafka. Fixtures are per
directory, so run together with ``tests/integration`` this package gets a broker of its own (as
``tests/reliability`` does). The other tests here use the embedded broker and need neither
Docker nor Go.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import otelcol, prometheus
from tests.harness.go_build import GoMissing
from tests.harness.system import Progress, progress_to
from tests.integration.conftest import (  # noqa: F401 — fixtures used by name
    harness_docker_engine,
    kafka_broker,
)


def _built(pytestconfig: pytest.Config, build: Callable[[Progress], Path]) -> Path:
    """A harness Go program, built on first use (progress on the terminal); skips without Go."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    try:
        return build(progress_to(reporter, "kvgate harness"))
    except GoMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def collector_binary(pytestconfig: pytest.Config) -> Path:
    return _built(pytestconfig, otelcol.build)


@pytest.fixture(scope="session")
def prometheus_binary(pytestconfig: pytest.Config) -> Path:
    return _built(pytestconfig, prometheus.build)
