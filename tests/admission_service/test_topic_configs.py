"""Reading the topics' record size limits (``max.message.bytes``) at start-up, on the embedded
broker (the real Tansu binary).

Tansu drops the connection on a DescribeConfigs request that names its keys, so every start of
``kvgate run`` used to warn twice that the broker "does not describe topic configs". Asked for
all of a topic's configs it answers (with none). A healthy start now says nothing above INFO;
a broker whose call fails is still warned about, once; one without the call is said at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IncompatibleBrokerVersion, KafkaConnectionError

from kvgate.admission_service import kafka_io
from kvgate.admission_service.kafka_io import TopicLimits, ensure_topics
from kvgate.admission_service.settings import KafkaSettings
from kvgate.local.embedded_broker import EmbeddedBroker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def bootstrap() -> AsyncIterator[str]:
    async with EmbeddedBroker() as broker:
        yield broker.bootstrap


def _settings(bootstrap: str) -> KafkaSettings:
    return KafkaSettings.model_validate({"bootstrap_servers": bootstrap, "partitions": 1})


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == kafka_io.__name__]


async def test_a_healthy_start_on_the_embedded_broker_warns_about_nothing(
    bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    limits = await ensure_topics(_settings(bootstrap))
    assert limits == TopicLimits(1, None, None)  # Tansu keeps no topic configs
    said = _said(caplog)
    assert [m for level, m in said if level >= logging.WARNING] == []
    notes = [m for _, m in said if "max.message.bytes" in m]
    assert notes == [
        "the broker reports no max.message.bytes for kvgate.requests, kvgate.requests.dlq: "
        "dead letters are sized by the producer's limit"
    ]


@pytest.mark.parametrize(
    ("error", "level", "said"),
    [
        (
            KafkaConnectionError("Connection at broker closed"),
            logging.WARNING,
            "the broker does not describe topic configs "
            "(KafkaConnectionError('Connection at broker closed'))",
        ),
        (
            IncompatibleBrokerVersion("DescribeConfigsRequest cannot be used"),
            logging.INFO,
            "the broker has no DescribeConfigs "
            "(IncompatibleBrokerVersion('DescribeConfigsRequest cannot be used')): "
            "max.message.bytes unknown",
        ),
    ],
    ids=["call-fails", "no-such-call"],
)
async def test_a_describe_configs_that_cannot_answer_is_said_once(
    bootstrap: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    level: int,
    said: str,
) -> None:
    async def refuse(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(AIOKafkaAdminClient, "describe_configs", refuse)
    caplog.set_level(logging.INFO)
    limits = await ensure_topics(_settings(bootstrap))
    assert limits == TopicLimits(1, None, None)
    about_configs = [
        (lv, m) for lv, m in _said(caplog) if "max.message.bytes" in m or "configs" in m
    ]
    assert about_configs == [(level, said)]
