"""The Kafka health poll: jittered pauses between checks, backing off while checks fail and
back to the interval once Kafka answers; the loop sleeps exactly those pauses."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvgate.admission_service import kafka_health
from kvgate.admission_service.kafka_health import OUTAGE_BACKOFF_FACTOR, KafkaHealth
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.settings import KafkaSettings

INTERVAL_S = 2.0


class ScriptedHealth(KafkaHealth):
    """A health poll whose metadata requests fail or succeed as scripted (no broker)."""

    def __init__(self, answers: list[bool], **options: object) -> None:
        settings = KafkaSettings(
            bootstrap_servers="127.0.0.1:1", health_check_interval_s=INTERVAL_S
        )
        super().__init__(settings, ServiceMetrics(), **options)  # type: ignore[arg-type]
        self.answers = list(answers)

    async def _fetch_metadata(self) -> None:
        if not self.answers.pop(0):
            raise ConnectionError("broker down")


def _ceiling(low: float, high: float) -> float:
    return high


async def test_pauses_double_while_checks_fail_and_reset_when_kafka_answers() -> None:
    health = ScriptedHealth([True, False, False, False, False, True], uniform=_ceiling)
    ceilings = []
    for _ in range(6):
        await health.check()
        ceilings.append(health.next_delay_s())
    cap = INTERVAL_S * OUTAGE_BACKOFF_FACTOR
    assert ceilings == [INTERVAL_S, 2 * INTERVAL_S, cap, cap, cap, INTERVAL_S]
    assert health.reachable


async def test_pauses_are_drawn_between_half_and_the_whole_step() -> None:
    health = ScriptedHealth([], uniform=random.Random(3).uniform)
    draws = {health.next_delay_s() for _ in range(100)}
    assert all(INTERVAL_S / 2 <= d <= INTERVAL_S for d in draws)
    assert max(draws) - min(draws) > 0.8 * (INTERVAL_S / 2)  # spread, not one fixed interval


async def test_the_loop_sleeps_the_jittered_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([1.25, 3.5, 1.75])
    health = ScriptedHealth([True, False, True], uniform=lambda low, high: next(draws))
    slept: list[float] = []

    async def sleep(delay_s: float) -> None:
        slept.append(delay_s)
        if len(slept) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr(kafka_health.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await health.run()
    assert slept == [1.25, 3.5, 1.75]
