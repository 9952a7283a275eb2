"""The per-token histogram exposes what prometheus_client's Histogram exposes for the same
observations (bounds included: Prometheus' ``le`` counts a value equal to its bound)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvgate.admission_service.metrics import VLLM_INTER_TOKEN_BUCKETS, TokenHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_token_histogram_matches_prometheus_histogram() -> None:
    name, bounds = "vllm:inter_token_latency_seconds", VLLM_INTER_TOKEN_BUCKETS
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram(name, "gaps", bounds)
    ours.register(fast)
    reference = Histogram(name, "gaps", ["model_name", "engine"], buckets=bounds, registry=theirs)
    values = [0.0, 0.004, 0.01, 0.0100001, 0.05, 0.3, 80.0, 80.5, 1000.0, *bounds]
    for index, value in enumerate(values):
        engine = f"e{index % 3}"
        fast.observe(("m", engine), value)
        reference.labels("m", engine).observe(value)
    expected = _samples(theirs)
    assert len(expected) == 3 * (len(bounds) + 1 + 2)  # buckets with +Inf, count, sum
    assert _samples(ours) == expected


def test_an_unobserved_token_histogram_exposes_no_series() -> None:
    registry = CollectorRegistry()
    registry.register(TokenHistogram("vllm:time_to_first_token_seconds", "ttft", (0.1, 1.0)))
    assert _samples(registry) == {}


def test_a_steps_observations_at_once_count_as_one_by_one() -> None:
    """``observe_all`` (a step's inter-token gaps in one call) against the reference histogram
    fed one value at a time: the same buckets and count, the sum up to its adding order."""
    name, bounds = "vllm:inter_token_latency_seconds", VLLM_INTER_TOKEN_BUCKETS
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = TokenHistogram(name, "gaps", bounds)
    ours.register(fast)
    reference = Histogram(name, "gaps", ["model_name", "engine"], buckets=bounds, registry=theirs)
    steps = [[0.0, 0.004, 0.01], [0.0100001, 0.05, 0.3, 80.0], [], [80.5, 1000.0, *bounds]]
    for step in steps:
        fast.observe_all(("m", "e0"), step)
        for value in step:
            reference.labels("m", "e0").observe(value)
    expected, got = _samples(theirs), _samples(ours)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value) if key[0].endswith("_sum") else value), key
