"""Fixtures of the reliability scenarios (docs/reliability.md).

The broker fixtures are the integration tier's (``tests/integration/conftest.py``): one Kafka
4.4 container per session, ``controllable_kafka`` for pausing and restarting it. Run together
with ``tests/integration`` in one session, this package gets a broker of its own (fixtures are
per directory), which keeps its pauses, restarts and load away from the other tier.

``slow`` tests (the full-size runs) are skipped unless selected: ``-m slow`` (or any ``-m``
expression naming ``slow``) or ``KVGATE_RELIABILITY_FULL=1``. Each scenario also has a reduced
version that always runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.admission_service.kafka_helpers import Topics
from tests.harness.kafka import ContainerKafka, KafkaBroker
from tests.integration.conftest import (  # noqa: F401 — fixtures used by name
    controllable_kafka,
    harness_docker_engine,
    kafka_broker,
)
from tests.reliability.cluster import Cluster
from tests.reliability.figures import Figures

_FIGURES = pytest.StashKey[Figures]()

FULL_ENV = "KVGATE_RELIABILITY_FULL"
_HERE = Path(__file__).parent
_LOG_TAIL_CHARS = 6000


def _in_this_package(item: pytest.Item) -> bool:
    return _HERE in Path(str(item.path)).parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = "slow" in (config.getoption("markexpr") or "") or os.environ.get(FULL_ENV) == "1"
    skip_slow = pytest.mark.skip(
        reason=f"full-size run: select it with -m slow or {FULL_ENV}=1 (docs/reliability.md)"
    )
    external = bool(os.environ.get("KAFKA_BOOTSTRAP"))
    for item in items:
        if not _in_this_package(item):
            continue
        if "kafka_broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
            if not external:
                item.add_marker(pytest.mark.docker)
        if "slow" in item.keywords and not selected:
            item.add_marker(skip_slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed scenario's report carries the end of every process log and the broker's."""
    report = yield
    if not report.failed:
        return report
    funcargs = getattr(item, "funcargs", {})
    cluster = funcargs.get("cluster")
    if isinstance(cluster, Cluster):
        for process in cluster.processes:
            tail = process.log_tail(_LOG_TAIL_CHARS)
            report.sections.append((f"{process.name} log (tail)", tail))
    broker = funcargs.get("kafka_broker") or funcargs.get("controllable_kafka")
    if isinstance(broker, ContainerKafka):
        report.sections.append(("kafka broker log (tail)", broker.logs()[-_LOG_TAIL_CHARS:]))
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FIGURES] = Figures()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    figures = config.stash.get(_FIGURES, None)
    if figures is not None and figures.rows:
        terminalreporter.section("kvgate reliability figures")
        for line in figures.lines():
            terminalreporter.write_line(line)


@pytest.fixture
def figures(pytestconfig: pytest.Config) -> Figures:
    """Where a scenario records what it measured (printed at the end of the run)."""
    return pytestconfig.stash[_FIGURES]


@pytest.fixture
def cluster(
    kafka_broker: KafkaBroker,  # noqa: F811 — the imported fixture, requested by name
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Cluster]:
    """Fresh topics and a process list for one scenario; every process stops at the end."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:40]
    stack = Cluster(kafka_broker, tmp_path, Topics.unique(label))
    try:
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="session")
def looped_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny looped (3-loop, Ouro-layout) checkpoint whose exit gate fires at every depth, so
    recompute must replay recorded exit depths to reproduce the outputs."""
    from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
    from kvgate.protocol.enums import ModelFamily

    spec = TinyModelSpec(
        family=ModelFamily.LOOPED, num_loops=3, vocab_size=128, exit_gate_bias=-0.3, seed=2
    )
    return make_tiny_model(tmp_path_factory.mktemp("looped-model"), spec)
