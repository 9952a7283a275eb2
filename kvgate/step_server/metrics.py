"""Prometheus metrics of one executor server, on a registry of its own (no module globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvgate.protocol import step as wire

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.steps = Counter(
            "kvgate_executor_steps", "Steps executed, by outcome (ok or error code)", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "kvgate_executor_step_seconds", "Wall time of a step", buckets=_STEP_BUCKETS, registry=r
        )
        self.kernel_seconds = Counter(
            "kvgate_executor_kernel_seconds", "Time spent in attention/KV kernels", registry=r
        )
        self.rows = Counter("kvgate_executor_rows", "Rows run, by kind", ["kind"], registry=r)
        self.tokens = Counter("kvgate_executor_sampled_tokens", "Tokens sampled", registry=r)
        self.sessions = Counter(
            "kvgate_executor_sessions", "Session attempts, by outcome", ["outcome"], registry=r
        )
        self.ready = Gauge(
            "kvgate_executor_ready", "1 once weights and KV cache are ready", registry=r
        )
        self.epoch = Gauge(
            "kvgate_executor_session_epoch", "Epoch of the current session", registry=r
        )
        self.requests = Gauge(
            "kvgate_executor_requests", "Requests held (with snapshots)", registry=r
        )
        self.snapshots = Gauge("kvgate_executor_snapshots", "Host snapshots held", registry=r)
        self.host_blocks = Gauge(
            "kvgate_executor_host_blocks_used", "Host snapshot blocks in use", registry=r
        )
        self.blocks_total = Gauge("kvgate_executor_kv_blocks", "KV cache blocks", registry=r)

    def observe(self, result: wire.StepResult, prefill_rows: int, decode_rows: int) -> None:
        outcome = "ok" if result.error is None else result.error.code.value
        self.steps.labels(outcome=outcome).inc()
        self.step_seconds.observe(result.timings.execute_s)
        if result.timings.kernel_s is not None:
            self.kernel_seconds.inc(result.timings.kernel_s)
        if result.error is None:
            self.rows.labels(kind="prefill").inc(prefill_rows)
            self.rows.labels(kind="decode").inc(decode_rows)
            self.tokens.inc(result.num_tokens)
        self.requests.set(result.counters.num_requests)
        self.snapshots.set(result.counters.num_snapshots)
        self.host_blocks.set(result.counters.host_blocks_used)
