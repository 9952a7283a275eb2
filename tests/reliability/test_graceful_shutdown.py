"""Scenario 8: SIGTERM under load.

The service stops fetching, lets running work finish for ``shutdown.grace_period_s``, hands off
what is left (unanswered, uncommitted), commits everything it answered and exits 0 within the
grace period plus its closing steps. A second instance then answers exactly the rest: nothing
below the committed offsets is unanswered, and nothing the first one answered runs again.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvgate.sim.backend import SimExecutorConfig
from tests.admission_service.kafka_helpers import committed_offsets
from tests.reliability.cluster import Cluster
from tests.reliability.traffic import read_answers
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(420, func_only=True)

GEOMETRY = {"num_blocks": 192, "block_size": 8}
PARTITIONS = 4
GRACE_S = 2.0
# After the grace period: hand-off, one last commit cycle per partition, the executor sessions,
# producers and the consumer closed, all within the service's closing budget (here they take
# about 1 s); the rest of the bound is the process's own exit.
CLOSING_BUDGET_S = 10.0
CLOSING_BOUND_S = CLOSING_BUDGET_S + 5.0


@pytest.mark.parametrize("requests", [60, pytest.param(300, marks=pytest.mark.slow, id="full")])
async def test_sigterm_commits_what_is_done_and_hands_off_the_rest(
    cluster: Cluster, requests: int
) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    bodies = mixed_bodies(requests, "t", vocab_size=512, max_tokens=(30, 60))
    reference = sim_reference(bodies, config)
    executors = cluster.sim_executors("exec-a", "exec-b", step_time_ms=20, **GEOMETRY)
    settings = cluster.settings(
        executors,
        kafka={"partitions": PARTITIONS},
        shutdown={"grace_period_s": GRACE_S, "closing_timeout_s": CLOSING_BUDGET_S},
    )
    first = cluster.service("service-1", settings)
    await cluster.send_requests(bodies)
    await read_answers(cluster.bootstrap, cluster.topics.results, requests // 6, settle_s=0)
    assert await asyncio.to_thread(first.metric, "kvgate_admission_requests_in_flight") > 0

    stopping_at = time.monotonic()
    first.process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.process.wait, GRACE_S + CLOSING_BOUND_S) == 0
    stop_s = time.monotonic() - stopping_at
    assert stop_s >= GRACE_S * 0.9, "it must give running work its grace period"
    assert "handing them off" in first.process.log_tail(1_000_000)

    # What the first instance committed: every request below each committed offset answered.
    topics = cluster.topics
    done = await read_answers(cluster.bootstrap, topics.results, 0, settle_s=2.0)
    committed = await committed_offsets(cluster.bootstrap, topics.group, topics.requests, 4)
    answered = {(r.source.partition, r.source.offset) for r in done if r.source is not None}
    below = {(s.partition, s.offset) for s in cluster.sent if s.offset < committed[s.partition]}
    assert below <= answered, f"committed past unanswered requests: {sorted(below - answered)}"
    assert 0 < len(done) < requests, "some work was handed off"

    second = cluster.service("service-2", settings)
    summary = await cluster.verify(reference, [second], executors)
    assert summary.completed == requests
    # The second instance ran exactly what the first did not answer.
    results_total = await asyncio.to_thread(second.metric, "kvgate_admission_results_total")
    assert results_total == requests - len(done)
