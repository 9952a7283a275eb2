"""Session fixtures for integration tests: a real Apache Kafka 4.4 broker on 127.0.0.1.

``kafka_broker`` is the harness's container (Docker engine found or started, image built or
taken from the cache, one broker per session) or, with ``KAFKA_BOOTSTRAP=host:port`` set, that
external broker. Tests that request it are marked ``kafka`` (and ``docker`` unless the broker
is external), so ``-m "not kafka"`` deselects them. ``controllable_kafka`` is for tests that
pause or restart the broker: it skips on an external broker and, after each test, undoes any
fault the test left behind. ``topic_factory`` / ``kafka_topic`` give each test fresh topics.
See docs/testing.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Mapping

import pytest

from tests.harness.docker_engine import DockerEngine, docker_engine
from tests.harness.kafka import ContainerKafka, ExternalKafka, KafkaBroker, reap_orphans
from tests.harness.kafka_client import (
    TopicFactory,
    create_topic,
    delete_topics_async,
    run_async,
)
from tests.harness.kafka_client import unique_topic_name as _unique_topic_name
from tests.harness.kafka_image import ensure_kafka_image
from tests.harness.system import Progress, cache_root, progress_to
from tests.harness.tls import self_signed_certificate

EXTERNAL_BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP"
_LOG_TAIL_CHARS = 8000


def _external_bootstrap() -> str | None:
    return os.environ.get(EXTERNAL_BOOTSTRAP_ENV) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    external = _external_bootstrap() is not None
    for item in items:
        if "kafka_broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
            if not external:
                item.add_marker(pytest.mark.docker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    funcargs = getattr(item, "funcargs", {})
    broker = funcargs.get("kafka_broker") or funcargs.get("controllable_kafka")
    if report.failed and isinstance(broker, ContainerKafka):
        report.sections.append(("kafka broker log (tail)", broker.logs()[-_LOG_TAIL_CHARS:]))
    return report


def _progress(config: pytest.Config) -> Progress:
    return progress_to(config.pluginmanager.get_plugin("terminalreporter"), "kvgate harness")


@pytest.fixture(scope="session")
def harness_docker_engine(pytestconfig: pytest.Config) -> Iterator[DockerEngine]:
    """A Docker engine for the session (see tests/harness/docker_engine.py)."""
    with docker_engine(cache_root(), _progress(pytestconfig)) as engine:
        yield engine


@pytest.fixture(scope="session")
def kafka_broker(
    request: pytest.FixtureRequest,
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[KafkaBroker]:
    """One Kafka broker for the whole session; its ``bootstrap`` is always 127.0.0.1:<port>.

    The harness's broker also has a TLS listener (``kafka_broker.tls``) with a certificate
    made for this session; an external broker has none.
    """
    external = _external_bootstrap()
    if external is not None:
        broker = ExternalKafka(external)
        broker.wait_ready()
        yield broker
        return
    engine: DockerEngine = request.getfixturevalue("harness_docker_engine")
    progress = _progress(pytestconfig)
    client = engine.client()
    try:
        for name in reap_orphans(client):
            progress(f"removed {name}, left behind by a test session that no longer runs")
        image = ensure_kafka_image(client, cache_root(), progress)
    finally:
        client.close()
    tls = self_signed_certificate(tmp_path_factory.mktemp("kafka-tls"), progress)
    container = ContainerKafka.start(engine.host, image, tls=tls)
    try:
        yield container
    finally:
        container.stop()


@pytest.fixture
def controllable_kafka(kafka_broker: KafkaBroker) -> Iterator[ContainerKafka]:
    """The harness's broker, for tests that pause or restart it; healed after each test."""
    if not isinstance(kafka_broker, ContainerKafka):
        pytest.skip(
            f"{EXTERNAL_BOOTSTRAP_ENV} points at an external broker; pausing or restarting "
            "needs the harness's own container (unset it to run this test)"
        )
    yield kafka_broker
    kafka_broker.ensure_running()


@pytest.fixture
def topic_factory(
    kafka_broker: KafkaBroker, request: pytest.FixtureRequest
) -> Iterator[TopicFactory]:
    """Create fresh, uniquely named topics (named after the test); ready when returned."""
    created: list[str] = []

    def make(
        *, partitions: int = 1, configs: Mapping[str, str] | None = None, label: str = ""
    ) -> str:
        name = _unique_topic_name(label or request.node.name)
        create_topic(kafka_broker.bootstrap, name, partitions=partitions, configs=configs)
        created.append(name)
        return name

    yield make
    # The harness's broker dies with the session; an external one is cleaned up after us.
    if created and not kafka_broker.controllable:
        bootstrap = kafka_broker.bootstrap
        run_async(lambda: delete_topics_async(bootstrap, created))


@pytest.fixture
def kafka_topic(topic_factory: TopicFactory) -> str:
    """One fresh single-partition topic."""
    return topic_factory()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Unique names for consumer groups and transactional ids: ``unique_name("group")``."""
    return lambda kind: _unique_topic_name(f"{kind}-{request.node.name}")
