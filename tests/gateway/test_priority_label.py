"""The gateway and the admission service label a request's priority alike (one function,
``kvgate.protocol.metric_labels.priority_label``), so their per-request series join."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.gateway.metrics import GatewayMetrics, request_labels
from kvgate.protocol.records import InferenceResult, ResultStatus, SourceRef, Timings, Usage

MODEL = "tiny"
EXPECTED = {
    -1000: "<-10",
    -11: "<-10",
    -10: "-10",
    -1: "-1",
    0: "0",
    1: "1",
    10: "10",
    11: ">10",
    1000: ">10",
}


def _result() -> InferenceResult:
    return InferenceResult(
        request_id="r",
        status=ResultStatus.COMPLETED,
        output_token_ids=[1, 2],
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queued_s=0.1, time_to_first_token_s=0.2, end_to_end_s=0.5),
        source=SourceRef(topic="t", partition=0, offset=0),
    )


def _series_labels(registry: CollectorRegistry, prefix: str) -> set[tuple[tuple[str, str], ...]]:
    """Every per-request series' (model, priority) labels, over all of its families."""
    return {
        tuple((name, sample.labels[name]) for name in ("model", "priority"))
        for family in registry.collect()
        if family.name.startswith(prefix)
        for sample in family.samples
        if "model" in sample.labels or "priority" in sample.labels
    }


@pytest.mark.parametrize("priority", list(EXPECTED))
def test_the_gateway_and_the_service_label_a_priority_alike(priority: int) -> None:
    gateway = GatewayMetrics()
    labels = request_labels(MODEL, priority)  # what the server puts on a request's series
    for histogram in (gateway.ttft, gateway.itl, gateway.e2e, gateway.queue):
        histogram.labels(**labels).observe(0.1)
    gateway.prompt_tokens.labels(**labels).inc(3)
    gateway.generation_tokens.labels(**labels).inc(2)
    service = ServiceMetrics(MODEL)
    service.observe_result(priority, _result())

    expected = {(("model", MODEL), ("priority", EXPECTED[priority]))}
    assert _series_labels(gateway.registry, "kvgate_gateway_") == expected
    assert _series_labels(service.registry, "kvgate_admission_") == expected
