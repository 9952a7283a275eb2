"""Scenario 3: the broker is paused (``docker pause``, every broker thread frozen, connections
left open) for at least 10 s, or killed and restarted on the same data volume, mid-workload.

The service must notice by itself (readiness 503 naming the outage, liveness still 200, the
``kafka_reachable`` gauge at 0) while the outage lasts, recover by itself once the broker
answers, and answer every request exactly once with the simulated model's outputs — including
requests produced after the outage.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from kvgate.sim.backend import SimExecutorConfig
from tests.harness.kafka import ContainerKafka
from tests.integration.admission_stack import Service
from tests.reliability.cluster import Cluster
from tests.reliability.processes import poll
from tests.reliability.traffic import read_answers
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(420, func_only=True)

GEOMETRY = {"num_blocks": 128, "block_size": 8, "loops": 2}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class HealthLog:
    """What the health endpoints said while the broker was down."""

    ready: list[tuple[int, str]] = field(default_factory=list)
    live: list[tuple[int, str]] = field(default_factory=list)
    reachable: list[float] = field(default_factory=list)

    def observe(self, service: Service) -> None:
        self.ready.append(_get(service.url("/readyz")))
        self.live.append(_get(service.url("/healthz")))
        self.reachable.append(service.metric("kvgate_admission_kafka_reachable"))

    @property
    def saw_outage(self) -> bool:
        return any(code == 503 and "kafka unreachable" in body for code, body in self.ready)


def _watch_pause(broker: ContainerKafka, service: Service, log: HealthLog, pause_s: float) -> None:
    """Pause for ``pause_s``; once readiness reports the outage it must keep reporting it."""
    broker.pause()
    paused_at = time.monotonic()
    while time.monotonic() - paused_at < pause_s:
        log.observe(service)
        if log.saw_outage:
            assert log.ready[-1][0] == 503, f"ready again while paused: {log.ready[-1]}"
            assert log.reachable[-1] == 0
        time.sleep(0.2)  # the pause length is the fault itself, not a wait for a condition
    broker.unpause()


async def _watch_restart(broker: ContainerKafka, service: Service, log: HealthLog) -> None:
    restarting = asyncio.create_task(asyncio.to_thread(broker.restart, hard=True))
    while not restarting.done():
        await asyncio.to_thread(log.observe, service)
        await asyncio.sleep(0.2)
    await restarting


@pytest.mark.parametrize(
    ("fault", "pause_s", "kafka"),
    [
        ("pause", 10.0, {}),
        ("restart", 0.0, {}),
        # Longer than the transaction timeout: the broker aborts the open transactions.
        pytest.param(
            "pause", 25.0, {"transaction_timeout_ms": 5000}, marks=pytest.mark.slow, id="long"
        ),
    ],
)
async def test_broker_outage_is_reported_and_survived(
    cluster: Cluster,
    controllable_kafka: ContainerKafka,
    fault: str,
    pause_s: float,
    kafka: dict[str, int],
) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    before = mixed_bodies(60, "b", vocab_size=512, num_loops=2, max_tokens=(20, 40))
    after = mixed_bodies(20, "a", vocab_size=512, num_loops=2)
    reference = sim_reference(before + after, config)
    executors = cluster.sim_executors("exec-a", "exec-b", step_time_ms=20, **GEOMETRY)
    service = cluster.service("service", cluster.settings(executors, kafka=kafka))
    await cluster.send_requests(before)
    await read_answers(cluster.bootstrap, cluster.topics.results, 10, settle_s=0)
    in_flight = await asyncio.to_thread(service.metric, "kvgate_admission_requests_in_flight")
    assert in_flight > 0, "the outage must fall mid-workload"

    log = HealthLog()
    if fault == "pause":
        await asyncio.to_thread(_watch_pause, controllable_kafka, service, log, pause_s)
    else:
        await _watch_restart(controllable_kafka, service, log)
    assert log.saw_outage, f"readiness never reported the outage: {log.ready}"
    assert 0 in log.reachable
    assert {code for code, _ in log.live} == {200}, "liveness must not fail for a broker outage"
    assert any("kafka unreachable" in body for _, body in log.live)
    await asyncio.to_thread(
        poll, lambda: _get(service.url("/readyz"))[0] == 200, "readiness after the outage", 90
    )

    await cluster.send_requests(after)
    summary = await cluster.verify(reference, [service], executors)
    assert summary.completed == len(before) + len(after)
    assert service.process.alive
    assert service.metric("kvgate_admission_kafka_outages_total") >= 1
    assert service.metric("kvgate_admission_kafka_reachable") == 1
