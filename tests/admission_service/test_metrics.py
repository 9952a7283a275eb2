"""Latency metrics: label sets stay bounded whatever priorities requests claim."""

from __future__ import annotations

from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.protocol.records import (
    InferenceResult,
    ResultStatus,
    SourceRef,
    Timings,
    Usage,
)


def result(ttft: float | None, e2e: float, tokens: int) -> InferenceResult:
    return InferenceResult(
        request_id="r",
        status=ResultStatus.COMPLETED,
        output_token_ids=list(range(tokens)),
        usage=Usage(prompt_tokens=3, completion_tokens=tokens),
        timings=Timings(queued_s=0.1, time_to_first_token_s=ttft, end_to_end_s=e2e),
        source=SourceRef(topic="t", partition=0, offset=0),
    )


def test_priorities_outside_the_labelled_range_share_two_labels() -> None:
    metrics = ServiceMetrics("SmolLM2-135M-Instruct")
    for priority in range(1000, -1001, -1):  # the service's default priority limits
        metrics.observe_result(priority, result(0.5, 1.5, 3))
    metrics.observe_result(3, result(0.5, 1.5, 3))
    labels = {
        sample.labels["priority"]
        for family in metrics.registry.collect()
        if family.name == "kvgate_admission_generation_tokens"
        for sample in family.samples
    }
    assert labels == {str(p) for p in range(-10, 11)} | {"<-10", ">10"}
    value = metrics.registry.get_sample_value
    model = {"model": "SmolLM2-135M-Instruct"}
    tokens = "kvgate_admission_generation_tokens_total"
    assert value(tokens, {**model, "priority": "<-10"}) == 990 * 3
    assert value(tokens, {**model, "priority": ">10"}) == 990 * 3
    assert value(tokens, {**model, "priority": "3"}) == 6
    assert value(tokens, {**model, "priority": "-10"}) == 3


def test_inter_token_latency_is_the_mean_gap_after_the_first_token() -> None:
    metrics = ServiceMetrics()
    metrics.observe_result(0, result(0.5, 2.5, 5))  # 4 gaps over 2 s
    metrics.observe_result(0, result(0.5, 0.5, 1))  # one token: no gap
    metrics.observe_result(0, result(None, 0.2, 0))  # never produced a token
    value = metrics.registry.get_sample_value
    label = {"model": "kvgate", "priority": "0"}
    assert value("kvgate_admission_time_per_output_token_seconds_count", label) == 1
    assert value("kvgate_admission_time_per_output_token_seconds_sum", label) == 0.5
    assert value("kvgate_admission_time_to_first_token_seconds_count", label) == 2
    assert value("kvgate_admission_request_queue_time_seconds_count", label) == 3
