"""What the gateway measures, per model and priority (its own registry).

The per-request series carry the labels the admission service's carry (``model``, and
``priority`` from ``kvgate.protocol.metric_labels``), so the two sides join on them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvgate.protocol.metric_labels import PRIORITY_LABEL, priority_label

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_LABELS = ["model", PRIORITY_LABEL]


def request_labels(model: str, priority: int) -> dict[str, str]:
    """The labels of one request's series."""
    return {"model": model, PRIORITY_LABEL: priority_label(priority)}


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvgate_gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvgate_gateway_time_to_first_token_seconds",
            "HTTP request received to first token seen (streamed requests)",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "kvgate_gateway_inter_token_latency_seconds",
            "between consecutive tokens seen (streamed requests)",
            _LABELS, buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "kvgate_gateway_e2e_request_latency_seconds",
            "HTTP request received to its answer",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "kvgate_gateway_queue_time_seconds",
            "read by the service to first admission (the service's figure, from the result)",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvgate_gateway_prompt_tokens", "prompt tokens of answered requests", _LABELS,
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "kvgate_gateway_generation_tokens", "generated tokens of answered requests", _LABELS,
            registry=r,
        )  # fmt: skip
        self.aborts = Counter(
            "kvgate_gateway_aborts", "aborts sent (client gone or timed out)", ["reason"],
            registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            "kvgate_gateway_rate_limited", "requests refused with 429", ["key"], registry=r
        )
