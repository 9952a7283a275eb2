"""Prometheus metrics of the admission service (one registry per service instance).

Counters are incremented where things happen; gauges that describe current state (queue depth,
running requests, KV blocks, executors by state, consumer lag, Kafka reachability) are read from
the live objects at scrape time by a collector, so they can never drift from the truth.

Leak checks read two views of every executor: what the service's scheduler accounts for
(``kv_blocks_used``, ``host_snapshot_blocks_used``) and what the executor itself reported holding
after its last step (``executor_held_*``, from ``StepResult.counters``). Once the service is idle
all of them are zero; a request, block or snapshot left behind on either side shows up here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.admission_service.scheduler.events import StepReport
from kvgate.protocol.records import InferenceResult
from kvgate.protocol.step import ExecutorCounters

# Distinct priorities with a label of their own on the latency metrics (the rest: "other").
PRIORITY_CLASSES = 16
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class ExecutorGauge:
    name: str
    state: str
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    host_blocks_used: int = 0  # host snapshot blocks, as the scheduler accounts them
    reported: ExecutorCounters | None = None  # what the executor said it holds (last step)


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """What the collector reads at scrape time."""

    unplaced: int  # read but not on any executor yet
    executors: list[ExecutorGauge]
    consumer_lag: dict[int, int]  # request partition -> records between committed and end
    paused: bool
    in_flight: int = 0  # read and not answered durably yet (running, waiting, or unwritten)
    kafka_reachable: bool = True  # the last health check of Kafka succeeded
    unwritten: dict[int, int] = field(default_factory=dict)  # partition -> answers not durable
    stalled_s: dict[int, float] = field(default_factory=dict)  # partition -> commits failing for


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], StateSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snapshot = self._read()
        waiting = GaugeMetricFamily(
            "kvgate_admission_waiting_requests", "requests queued, not running", labels=["executor"]
        )
        running = GaugeMetricFamily(
            "kvgate_admission_running_requests", "requests running", labels=["executor"]
        )
        used = GaugeMetricFamily(
            "kvgate_admission_kv_blocks_used", "KV cache blocks in use", labels=["executor"]
        )
        total = GaugeMetricFamily(
            "kvgate_admission_kv_blocks_total", "KV cache blocks", labels=["executor"]
        )
        state = GaugeMetricFamily(
            "kvgate_admission_executor_state",
            "1 for the executor's state",
            labels=["executor", "state"],
        )
        host = GaugeMetricFamily(
            "kvgate_admission_host_snapshot_blocks_used",
            "host snapshot blocks held for preempted requests (scheduler accounting)",
            labels=["executor"],
        )
        held = {
            what: GaugeMetricFamily(
                f"kvgate_admission_executor_held_{what}",
                f"{what.replace('_', ' ')} the executor reported holding after its last step",
                labels=["executor"],
            )
            for what in ("requests", "snapshots", "host_blocks")
        }
        waiting.add_metric(["(unplaced)"], snapshot.unplaced)
        for ex in snapshot.executors:
            waiting.add_metric([ex.name], ex.waiting)
            running.add_metric([ex.name], ex.running)
            used.add_metric([ex.name], ex.kv_blocks_used)
            total.add_metric([ex.name], ex.kv_blocks_total)
            state.add_metric([ex.name, ex.state], 1)
            host.add_metric([ex.name], ex.host_blocks_used)
            if ex.reported is not None:
                held["requests"].add_metric([ex.name], ex.reported.num_requests)
                held["snapshots"].add_metric([ex.name], ex.reported.num_snapshots)
                held["host_blocks"].add_metric([ex.name], ex.reported.host_blocks_used)
        queue = GaugeMetricFamily(
            "kvgate_admission_queue_depth", "requests waiting across executors and unplaced"
        )
        queue.add_metric([], snapshot.unplaced + sum(e.waiting for e in snapshot.executors))
        lag = GaugeMetricFamily(
            "kvgate_admission_consumer_lag", "request records not yet read", labels=["partition"]
        )
        for partition, records in sorted(snapshot.consumer_lag.items()):
            lag.add_metric([str(partition)], records)
        paused = GaugeMetricFamily("kvgate_admission_paused", "1 while backpressure pauses intake")
        paused.add_metric([], 1 if snapshot.paused else 0)
        in_flight = GaugeMetricFamily(
            "kvgate_admission_requests_in_flight", "requests read and not answered yet"
        )
        in_flight.add_metric([], snapshot.in_flight)
        kafka = GaugeMetricFamily(
            "kvgate_admission_kafka_reachable", "1 while the last Kafka health check succeeded"
        )
        kafka.add_metric([], 1 if snapshot.kafka_reachable else 0)
        unwritten = GaugeMetricFamily(
            "kvgate_admission_unwritten_answers",
            "answers made and not yet durable in Kafka",
            labels=["partition"],
        )
        for partition, count in sorted(snapshot.unwritten.items()):
            unwritten.add_metric([str(partition)], count)
        stalled = GaugeMetricFamily(
            "kvgate_admission_commit_stalled_seconds",
            "how long the partition's commit cycles have been failing (0 while they succeed)",
            labels=["partition"],
        )
        for partition in sorted(snapshot.unwritten.keys() | snapshot.stalled_s.keys()):
            stalled.add_metric([str(partition)], snapshot.stalled_s.get(partition, 0.0))
        yield from (queue, waiting, running, used, total, state, lag, paused)
        yield from (host, *held.values(), in_flight, kafka, unwritten, stalled)


class ServiceMetrics:
    def __init__(self, model_name: str = "kvgate") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._model = model_name
        self.received = Counter("kvgate_admission_requests_received", "records read", registry=r)
        self.results = Counter(
            "kvgate_admission_results", "results produced", ["status"], registry=r
        )
        self.rejections = Counter(
            "kvgate_admission_rejections", "requests rejected", ["code"], registry=r
        )
        self.dead_letters = Counter(
            "kvgate_admission_dead_letters", "records sent to the dead-letter topic", registry=r
        )
        self.preemptions = Counter(
            "kvgate_admission_preemptions", "preemptions", ["mode"], registry=r
        )
        self.bypasses = Counter(
            "kvgate_admission_bypasses", "admission bypass increments", registry=r
        )
        # The promise and the margin: no request is bypassed more than the limit.
        self.bypass_limit = Gauge(
            "kvgate_admission_bypass_limit",
            "configured max_admission_bypasses (set from the first step on)",
            registry=r,
        )
        self.max_bypasses_seen = Gauge(
            "kvgate_admission_max_bypasses_seen",
            "largest bypass count of any request since the service started",
            registry=r,
        )
        self._max_bypasses_seen = 0
        self.steps = Counter("kvgate_admission_steps", "steps applied", ["executor"], registry=r)
        self.executor_losses = Counter(
            "kvgate_admission_executor_losses", "sessions that broke", ["executor"], registry=r
        )
        self.aborts = Counter("kvgate_admission_aborts", "abort messages read", registry=r)
        self.migrations = Counter(
            "kvgate_admission_migrations",
            "requests lifted from a draining executor, by how they moved (migrated with their "
            "KV, or the reason they fell back to recompute)",
            ["outcome"],
            registry=r,
        )
        self.migrated_bytes = Counter(
            "kvgate_admission_migrated_bytes", "KV snapshot bytes moved by migrations", registry=r
        )
        self.migration_seconds = Histogram(
            "kvgate_admission_migration_seconds",
            "time from a snapshot's export to its placement on the receiver",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.commits = Counter("kvgate_admission_commits", "commit cycles", ["outcome"], registry=r)
        self.truncated_dead_letters = Counter(
            "kvgate_admission_truncated_dead_letters",
            "dead letters too large for the dead-letter topic, written as a truncated copy",
            registry=r,
        )
        self.kafka_outages = Counter(
            "kvgate_admission_kafka_outages", "times Kafka stopped answering health checks",
            registry=r,
        )  # fmt: skip
        self.step_round_trip = Histogram(
            "kvgate_admission_step_round_trip_seconds",
            "plan sent to result received",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )

        # Request latencies and token counts, by served model (one per service: the name that
        # clients and spans use, telemetry.model_name) and priority class (_priority_label).
        by_priority = ["model", "priority"]
        self.queue_time = Histogram(
            "kvgate_admission_request_queue_time_seconds",
            "read from Kafka to first admitted to an executor",
            by_priority, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "kvgate_admission_time_to_first_token_seconds",
            "read from Kafka to its first output token",
            by_priority, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "kvgate_admission_time_per_output_token_seconds",
            "a request's mean inter-token latency after its first token",
            by_priority, buckets=INTER_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.end_to_end = Histogram(
            "kvgate_admission_request_latency_seconds",
            "read from Kafka to its result",
            [*by_priority, "status"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvgate_admission_prompt_tokens", "prompt tokens of answered requests",
            by_priority, registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "kvgate_admission_generation_tokens", "output tokens of answered requests",
            by_priority, registry=r,
        )  # fmt: skip
        self._priority_labels: dict[int, str] = {}

    def observe_result(self, priority: int, result: InferenceResult) -> None:
        """Latencies and token counts of one answered request (rejections included in the
        end-to-end latency only: they never queued)."""
        labels = (self._model, self._priority_label(priority))
        timings = result.timings
        self.end_to_end.labels(*labels, result.status.value).observe(timings.end_to_end_s)
        if timings.queued_s is not None:
            self.queue_time.labels(*labels).observe(timings.queued_s)
        ttft = timings.time_to_first_token_s
        if ttft is not None:
            self.time_to_first_token.labels(*labels).observe(ttft)
            after_first = result.usage.completion_tokens - 1
            if after_first > 0:
                per_token = max(timings.end_to_end_s - ttft, 0.0) / after_first
                self.time_per_output_token.labels(*labels).observe(per_token)
        self.prompt_tokens.labels(*labels).inc(result.usage.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(result.usage.completion_tokens)

    def _priority_label(self, priority: int) -> str:
        """The first PRIORITY_CLASSES distinct priorities seen get their own label, later
        ones share "other": priorities span thousands of values, label sets must not."""
        label = self._priority_labels.get(priority)
        if label is None:
            label = str(priority) if len(self._priority_labels) < PRIORITY_CLASSES else "other"
            if label != "other":
                self._priority_labels[priority] = label
        return label

    def bind_state(self, read: Callable[[], StateSnapshot]) -> None:
        self.registry.register(_StateCollector(read))

    def observe_step(self, report: StepReport) -> None:
        for preemption in report.preemptions:
            self.preemptions.labels(mode=preemption.mode.value).inc()
        self.bypass_limit.set(report.bypass_limit)
        if report.bypassed:
            self.bypasses.inc(len(report.bypassed))
        if report.max_bypasses > self._max_bypasses_seen:
            self._max_bypasses_seen = report.max_bypasses
            self.max_bypasses_seen.set(report.max_bypasses)
