"""No request waits forever under any placement: random request mixes over two to four simulated
executors (exact outputs: ``SimExecutor``), placed by the service's cache-aware rule (with
waiting requests pulled by executors that free up), by the rule before it (most headroom) or
round robin, with tenants, weights and deadline order in the schedulers. Arrivals are close
together and caches tight, so requests queue, are bypassed and move. Every request must finish,
every scheduler's invariants (the bypass bound and the fair order among them) must hold after
every step, and every request's outputs must equal a run of it alone."""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.admission_service.placement import (
    Ask,
    ExecutorView,
    PlacementPolicy,
    PlacementSettings,
    Placer,
)
from kvgate.scheduler.config import Fairness, SchedulerConfig
from kvgate.sim.cluster import Cluster, ClusterRequest, Node, build_node
from kvgate.sim.counting_executor import CountingExecutor
from kvgate.sim.executor import SimExecutor
from kvgate.sim.simulate import simulated_reference
from kvgate.sim.workload import CacheSection, ModelSection, Workload, WorkloadRequest

EXAMPLES = int(os.environ.get("KVGATE_PROPERTY_EXAMPLES_CLUSTER", "120"))
MODEL = ModelSection(loops=1, vocab_size=40, seed=3)
BLOCK_SIZE = 2


class _RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def rank(self, ask: Ask, executors: Sequence[Node]) -> Sequence[ExecutorView]:
        first = self._next % len(executors)
        self._next += 1
        return [*executors[first:], *executors[:first]]


@st.composite
def cluster_runs(draw: st.DrawFn) -> tuple[str, list[int], SchedulerConfig, list[ClusterRequest]]:
    placement = draw(st.sampled_from(["cache-aware", "headroom", "round-robin"]))
    shared = draw(st.lists(st.integers(0, 39), min_size=0, max_size=12))
    requests = []
    for index in range(draw(st.integers(1, 14))):
        tail = draw(st.lists(st.integers(0, 39), min_size=1, max_size=16))
        prompt = (*shared, *tail) if draw(st.booleans()) else tuple(tail)
        requests.append(
            ClusterRequest(
                request_id=f"r{index}",
                prompt_token_ids=prompt,
                max_tokens=draw(st.integers(1, 8)),
                arrival_s=draw(st.floats(0.0, 0.02)),  # close together: they queue
                priority=draw(st.integers(0, 2)),
                tenant=draw(st.sampled_from(["a", "b", "c", None])),
                deadline_s=draw(st.one_of(st.none(), st.floats(1e6, 2e6))),  # orders, never due
                affinity_key=draw(st.sampled_from([None, "k1", "k2"])),
                seed=draw(st.integers(0, 3)),
            )
        )
    largest = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // BLOCK_SIZE) for r in requests)
    blocks = [draw(st.integers(largest, largest * 2)) for _ in range(draw(st.integers(2, 4)))]
    budget = draw(st.integers(2, 16))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=budget,
        prefill_chunk_size=draw(st.integers(1, budget)),
        max_admission_bypasses=draw(st.integers(0, 3)),
        async_scheduling=False,
        watermark_ratio=0.0,
        min_residency_steps=draw(st.integers(0, 3)),
        stall_steps=200,
        fairness=draw(st.sampled_from(list(Fairness))),
        tenant_weights=draw(
            st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from([0.5, 2.0]))
        ),
        fair_burst_tokens=draw(st.sampled_from([0, 16, 2048])),
        deadline_order=draw(st.booleans()),
        deadline_slack_s=draw(st.sampled_from([0.01, 1.0])),
    )
    return placement, blocks, config, requests


def _reference(requests: list[ClusterRequest]) -> dict[str, tuple[int, ...]]:
    workload = Workload(
        model=MODEL,
        cache=CacheSection(num_blocks=1, block_size=BLOCK_SIZE),
        requests=[
            WorkloadRequest(
                id=r.request_id,
                prompt=list(r.prompt_token_ids),
                max_tokens=r.max_tokens,
                seed=r.seed,
            )
            for r in requests
        ],
    )
    run = simulated_reference(workload)
    return {rid: outcome.output_token_ids for rid, outcome in run.outcomes.items()}


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cluster_runs())
def test_every_request_finishes_under_any_placement(
    run: tuple[str, list[int], SchedulerConfig, list[ClusterRequest]],
) -> None:
    placement_name, blocks, config, requests = run
    nodes = [
        build_node(
            f"e{i}",
            config,
            SimExecutor(
                MODEL, num_blocks=num_blocks, block_size=BLOCK_SIZE, host_snapshot_blocks=host
            ),
            check=True,
        )
        for i, num_blocks in enumerate(blocks)
        for host in [num_blocks // 2]
    ]
    if placement_name == "round-robin":
        cluster = Cluster(nodes, _RoundRobin())
    else:
        policy = PlacementPolicy(placement_name.replace("-", "_"))
        cluster = Cluster(nodes, Placer(PlacementSettings(policy=policy, move_margin_tokens=0)))
    for request in requests:
        cluster.submit(request)
    result = cluster.run(max_time_s=1e5)
    unfinished = [rid for rid, o in result.outcomes.items() if o.event is None]
    assert unfinished == [] and len(result.outcomes) == len(requests)
    expected = _reference(requests)
    for rid, outcome in result.outcomes.items():
        assert outcome.event is not None
        assert outcome.event.output_token_ids == expected[rid], rid
        assert outcome.event.stats.bypasses <= config.max_admission_bypasses
    for node in nodes:
        assert not node.scheduler.has_work
        assert node.scheduler.state.pool.num_used_blocks == 0


def test_the_counting_executor_samples_the_same_tokens_under_any_placement() -> None:
    """The benchmarks' fast executor: a request's tokens depend on the request alone, never on
    where or with what it ran, and each request gets exactly ``max_tokens`` of them."""
    requests = [
        ClusterRequest(
            request_id=f"r{i}",
            prompt_token_ids=tuple(range(i % 3, 20 + i)),
            max_tokens=3 + i % 5,
            arrival_s=0.001 * i,
            seed=i % 2,
        )
        for i in range(12)
    ]
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8)
    outputs = []
    for placement in (_RoundRobin(), Placer(PlacementSettings())):
        nodes = [
            build_node(
                f"e{i}",
                config,
                CountingExecutor(name=f"e{i}", num_blocks=40, block_size=4),
                check=True,
            )
            for i in range(3)
        ]
        cluster = Cluster(nodes, placement)
        for request in requests:
            cluster.submit(request)
        result = cluster.run()
        finished = {rid: o.event for rid, o in result.outcomes.items() if o.event is not None}
        assert len(finished) == len(requests)
        outputs.append({rid: event.output_token_ids for rid, event in finished.items()})
    assert outputs[0] == outputs[1]
    for request in requests:
        assert len(outputs[0][request.request_id]) == request.max_tokens
