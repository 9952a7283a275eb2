"""The vLLM-compatible series: vLLM's names and label set (model_name, engine) beside kvgate's
own, per executor, with the unplaced requests counted as waiting."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvgate.admission_service.metrics import ExecutorGauge, ServiceMetrics, StateSnapshot
from kvgate.scheduler.events import StepReport


def _metrics() -> ServiceMetrics:
    metrics = ServiceMetrics(model_name="m")
    executors = [
        ExecutorGauge("e0", "ready", waiting=3, running=2, kv_blocks_used=30, kv_blocks_total=120),
        ExecutorGauge("e1", "ready", waiting=0, running=1, kv_blocks_used=0, kv_blocks_total=0),
    ]
    metrics.bind_state(
        lambda: StateSnapshot(unplaced=4, executors=executors, consumer_lag={}, paused=False)
    )
    return metrics


def test_the_scheduler_gauges_have_vllm_names_and_labels() -> None:
    value = _metrics().registry.get_sample_value
    assert value("vllm:num_requests_waiting", {"model_name": "m", "engine": "e0"}) == 3
    assert value("vllm:num_requests_waiting", {"model_name": "m", "engine": "(unplaced)"}) == 4
    assert value("vllm:num_requests_running", {"model_name": "m", "engine": "e1"}) == 1
    assert value("vllm:kv_cache_usage_perc", {"model_name": "m", "engine": "e0"}) == 0.25
    # An executor that reported no cache yet has no usage (not a division by zero).
    assert value("vllm:kv_cache_usage_perc", {"model_name": "m", "engine": "e1"}) is None


def test_prefix_cache_preemptions_and_latencies_per_executor() -> None:
    metrics = _metrics()
    report = StepReport(step_id=1, prefix_queried_tokens=100, prefix_hit_tokens=64)
    metrics.observe_step(report, "e0")
    metrics.observe_first_token("e0", 0.2)
    metrics.observe_token_gaps("e0", [0.03, 0.5])
    metrics.observe_finished("e0", 1.5, 0.1)
    value = metrics.registry.get_sample_value
    engine = {"model_name": "m", "engine": "e0"}
    assert value("vllm:prefix_cache_queries_total", engine) == 100
    assert value("vllm:prefix_cache_hits_total", engine) == 64
    assert value("kvgate_admission_prefix_cache_hit_tokens_total", {"executor": "e0"}) == 64
    assert value("kvgate_admission_prefix_cache_miss_tokens_total", {"executor": "e0"}) == 36
    assert value("vllm:time_to_first_token_seconds_count", engine) == 1
    assert value("vllm:time_to_first_token_seconds_bucket", engine | {"le": "0.25"}) == 1
    assert value("vllm:inter_token_latency_seconds_count", engine) == 2
    assert value("vllm:inter_token_latency_seconds_sum", engine) == pytest.approx(0.53)
    assert value("vllm:e2e_request_latency_seconds_sum", engine) == 1.5
    assert value("vllm:request_queue_time_seconds_count", engine) == 1
    exposition = generate_latest(metrics.registry).decode()
    assert 'vllm:num_requests_running{engine="e0",model_name="m"} 2.0' in exposition
