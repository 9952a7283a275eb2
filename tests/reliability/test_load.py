"""Scenario 7: load. Many requests through the whole stack with simulated executors behind the
real WebSocket protocol (no step time), so what is measured is the admission service: Kafka in,
validation, placement, scheduling, the step protocol, transactions out.

Figures (printed at the end of the run; docs/reliability.md records them):

- throughput: requests answered per second in the second of two equal bursts (the first warms
  up), from its first request's Kafka timestamp to the last result's (both stamped by their
  producers on this machine);
- queueing delay p50/p99: ``timings.queued_s`` of each result, from when the service read the
  request to its first admission; end to end p50/p99 likewise (read to answered);
- resident memory of the service at start, after the first of two equal bursts, and at the
  end. The first burst sets the heap's high-water mark (thousands of requests queued at once
  under backpressure); the second must fit in it, within a stated bound.
"""

from __future__ import annotations

import statistics

import pytest

from kvgate.protocol.records import InferenceResult
from kvgate.sim.backend import SimExecutorConfig
from tests.admission_service.kafka_helpers import read_all
from tests.reliability.cluster import Cluster
from tests.reliability.figures import MIB, Figures
from tests.reliability.processes import rss_bytes
from tests.reliability.workloads import mixed_bodies, sim_reference

pytestmark = pytest.mark.timeout(1800, func_only=True)

GEOMETRY = {"num_blocks": 1024, "block_size": 16}
# Production-sized batches (the scheduler's defaults), not the small ones of the fault tests.
SCHEDULER = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "prefill_chunk_size": 256}
# The second burst may add this much resident memory beyond the first one's high-water mark.
GROWTH_BOUND = 32 * MIB


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@pytest.mark.parametrize(
    "requests", [2000, pytest.param(20_000, marks=pytest.mark.slow, id="full")]
)
async def test_load_is_held_exactly_once(cluster: Cluster, figures: Figures, requests: int) -> None:
    config = SimExecutorConfig(**GEOMETRY)
    bodies = mixed_bodies(requests, "l", vocab_size=512, prompt_tokens=(8, 64), max_tokens=(4, 16))
    reference = sim_reference(bodies, config)
    executors = cluster.sim_executors("exec-a", "exec-b", **GEOMETRY)
    settings = cluster.settings(executors, scheduler=SCHEDULER, kafka={"partitions": 6})
    service = cluster.service("service", settings)
    rss_start = rss_bytes(service.process)

    half = requests // 2
    await cluster.send_requests(bodies[:half])
    await read_all(cluster.bootstrap, cluster.topics.results, until_count=half, timeout_s=900)
    rss_warm = rss_bytes(service.process)
    second = await cluster.send_requests(bodies[half:])
    records = await read_all(
        cluster.bootstrap, cluster.topics.results, until_count=requests, timeout_s=900
    )
    rss_end = rss_bytes(service.process)

    summary = await cluster.verify(reference, [service], executors, timeout_s=900)
    assert summary.completed == requests
    assert rss_end - rss_warm < GROWTH_BOUND, (rss_start, rss_warm, rss_end)
    # Throughput of the second burst (warmed up): its first request to the last result.
    span_s = (max(r.timestamp for r in records) - min(s.timestamp_ms for s in second)) / 1000
    results = [InferenceResult.model_validate_json(r.value) for r in records]
    queued = [r.timings.queued_s for r in results if r.timings.queued_s is not None]
    e2e = [r.timings.end_to_end_s for r in results]
    figures.record(
        "load",
        requests=requests,
        second_burst_s=span_s,
        requests_per_s=len(second) / span_s,
        queued_p50_ms=1000 * _percentile(queued, 50),
        queued_p99_ms=1000 * _percentile(queued, 99),
        e2e_p50_ms=1000 * _percentile(e2e, 50),
        e2e_p99_ms=1000 * _percentile(e2e, 99),
        rss_start_mib=rss_start / MIB,
        rss_warm_mib=rss_warm / MIB,
        rss_end_mib=rss_end / MIB,
    )
