"""Prometheus metrics of the admission service (one registry per service instance).

Counters are incremented where things happen; gauges that describe current state (queue depth,
running requests, KV blocks, executors by state, consumer lag, Kafka reachability) are read from
the live objects at scrape time by a collector, so they can never drift from the truth.

Beside the ``kvgate_*`` series, the service exports the names dashboards, KEDA scalers and the
Gateway API Inference Extension read from vLLM (``vllm:*``, labelled ``model_name`` and
``engine`` = the executor's name, as vLLM labels each engine): waiting and running requests, KV
cache usage (0–1), prefix-cache queries and hits (tokens), preemptions, and the time to first
token, inter-token, end-to-end and queue time histograms. docs/observability.md lists them and
how each is measured here.

Leak checks read two views of every executor: what the service's scheduler accounts for
(``kv_blocks_used``, ``host_snapshot_blocks_used``) and what the executor itself reported holding
after its last step (``executor_held_*``, from ``StepResult.counters``). Once the service is idle
all of them are zero; a request, block or snapshot left behind on either side shows up here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvgate.protocol.metric_labels import PRIORITY_LABEL, priority_label
from kvgate.protocol.records import InferenceResult
from kvgate.protocol.step import ExecutorCounters
from kvgate.scheduler.events import StepReport

# How prometheus_client writes a bucket's "le" (untyped there).
_le_label = cast(Callable[[float], str], floatToGoString)

UNPLACED = "(unplaced)"  # the executor label of requests not on any executor yet
VLLM_LABELS = ("model_name", "engine")
# vLLM's own buckets, so quantiles computed from either agree.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
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
    def __init__(self, read: Callable[[], StateSnapshot], model_name: str) -> None:
        self._read = read
        self._model = model_name

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
        yield from self._vllm_gauges(snapshot)

    def _vllm_gauges(self, snapshot: StateSnapshot) -> Iterator[Metric]:
        """vLLM's scheduler gauges, one series per executor ("engine"); requests not on any
        executor yet count as waiting under engine "(unplaced)", so sums are the pool's."""
        labels = ["model_name", "engine"]
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "requests waiting (vLLM-compatible)", labels=labels
        )
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "requests running (vLLM-compatible)", labels=labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "fraction of KV cache blocks in use, 0 to 1 (vLLM-compatible)",
            labels=labels,
        )
        waiting.add_metric([self._model, UNPLACED], snapshot.unplaced)
        for ex in snapshot.executors:
            waiting.add_metric([self._model, ex.name], ex.waiting)
            running.add_metric([self._model, ex.name], ex.running)
            if ex.kv_blocks_total:
                usage.add_metric([self._model, ex.name], ex.kv_blocks_used / ex.kv_blocks_total)
        yield from (waiting, running, usage)


class TokenHistogram(Collector):
    """A histogram observed once per output token, labelled (model_name, engine).

    ``prometheus_client.Histogram`` resolves its labels and takes locks on every ``observe``:
    about a quarter of the service's CPU per decode step (``benchmarks/bench_step_path.py``:
    4.4 → 3.2 ms per 240-row step; docs/benchmarks.md). Here an observation is one ``bisect``
    and two additions, about 5× cheaper; buckets are made cumulative at scrape time. No lock:
    observations and scrapes both run on the service's event loop (the admin endpoint calls
    ``generate_latest`` there). The exposition is the one ``Histogram`` writes (``_bucket``
    with ``le``, ``_count``, ``_sum``), without ``_created``.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        assert list(buckets) == sorted(buckets), "bucket bounds must ascend"
        self._name = name
        self._documentation = documentation
        self._bounds = buckets
        self._le = [_le_label(b) for b in buckets] + ["+Inf"]
        # (model_name, engine) -> per-bucket counts (last: above every bound) and their sum
        self._counts: dict[tuple[str, str], list[int]] = {}
        self._sums: dict[tuple[str, str], float] = {}

    def observe(self, labels: tuple[str, str], value: float) -> None:
        counts = self._counts.get(labels)
        if counts is None:
            counts = self._counts[labels] = [0] * (len(self._bounds) + 1)
            self._sums[labels] = 0.0
        # bisect_left: the first bound >= value, as Prometheus' "le" (less or equal) counts it
        counts[bisect_left(self._bounds, value)] += 1
        self._sums[labels] += value

    def observe_all(self, labels: tuple[str, str], values: Iterable[float]) -> None:
        """``observe`` each of ``values`` (a step's, in one call)."""
        counts = self._counts.get(labels)
        if counts is None:
            counts = self._counts[labels] = [0] * (len(self._bounds) + 1)
            self._sums[labels] = 0.0
        bounds, total = self._bounds, 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self._sums[labels] += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(VLLM_LABELS))
        for labels, counts in self._counts.items():
            cumulative: list[tuple[str, float]] = []
            total = 0
            for le, count in zip(self._le, counts, strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric(list(labels), cumulative, self._sums[labels])
        yield family


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
        self.placement_moves = Counter(
            "kvgate_admission_placement_moves",
            "waiting requests moved to an executor that freed up or joined (placement)",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "kvgate_admission_prefix_cache_hit_tokens",
            "prompt tokens found in the executor's prefix cache when a request started there",
            ["executor"], registry=r,
        )  # fmt: skip
        self.prefix_miss_tokens = Counter(
            "kvgate_admission_prefix_cache_miss_tokens",
            "prompt tokens looked up and not found in the executor's prefix cache (computed)",
            ["executor"], registry=r,
        )  # fmt: skip
        self._vllm_metrics(r)
        self.step_round_trip = Histogram(
            "kvgate_admission_step_round_trip_seconds",
            "plan sent to result received",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )

        # Request latencies and token counts, by served model (one per service: the name that
        # clients and spans use, telemetry.model_name) and priority (the gateway's labels too).
        by_priority = ["model", PRIORITY_LABEL]
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

    def _vllm_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's names (see the module docstring); observed per executor ("engine")."""
        labels = list(VLLM_LABELS)
        self.vllm_prefix_queries = Counter(
            "vllm:prefix_cache_queries", "prefix cache queries, in prompt tokens looked up",
            labels, registry=r,
        )  # fmt: skip
        self.vllm_prefix_hits = Counter(
            "vllm:prefix_cache_hits", "prefix cache hits, in prompt tokens found cached",
            labels, registry=r,
        )  # fmt: skip
        self.vllm_preemptions = Counter("vllm:num_preemptions", "preemptions", labels, registry=r)
        # Observed per output token: TokenHistogram (see there).
        self.vllm_ttft = TokenHistogram(
            "vllm:time_to_first_token_seconds",
            "read from Kafka to the first output token",
            VLLM_TTFT_BUCKETS,
        )
        self.vllm_inter_token = TokenHistogram(
            "vllm:inter_token_latency_seconds",
            "time between consecutive output tokens",
            VLLM_INTER_TOKEN_BUCKETS,
        )
        r.register(self.vllm_ttft)
        r.register(self.vllm_inter_token)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "read from Kafka to the last output token",
            labels, buckets=VLLM_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.vllm_queue_time = Histogram(
            "vllm:request_queue_time_seconds", "read from Kafka to first admitted",
            labels, buckets=VLLM_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_first_token(self, executor: str, since_read_s: float) -> None:
        """A request's first output token on ``executor``, ``since_read_s`` after it was read."""
        self.vllm_ttft.observe((self._model, executor), since_read_s)

    def observe_token_gaps(self, executor: str, gaps_s: Iterable[float]) -> None:
        """The times between requests' output tokens and their previous ones on ``executor``
        (a step's)."""
        self.vllm_inter_token.observe_all((self._model, executor), gaps_s)

    def observe_finished(self, executor: str, latency_s: float, queued_s: float | None) -> None:
        self.vllm_e2e.labels(self._model, executor).observe(latency_s)
        if queued_s is not None:
            self.vllm_queue_time.labels(self._model, executor).observe(queued_s)

    def observe_result(self, priority: int, result: InferenceResult) -> None:
        """Latencies and token counts of one answered request (rejections included in the
        end-to-end latency only: they never queued)."""
        labels = (self._model, priority_label(priority))
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

    def bind_state(self, read: Callable[[], StateSnapshot]) -> None:
        self.registry.register(_StateCollector(read, self._model))

    def observe_step(self, report: StepReport, executor: str) -> None:
        for preemption in report.preemptions:
            self.preemptions.labels(mode=preemption.mode.value).inc()
        if report.preemptions:
            self.vllm_preemptions.labels(self._model, executor).inc(len(report.preemptions))
        if report.prefix_queried_tokens:
            hits = report.prefix_hit_tokens
            self.prefix_hit_tokens.labels(executor=executor).inc(hits)
            self.prefix_miss_tokens.labels(executor=executor).inc(
                report.prefix_queried_tokens - hits
            )
            self.vllm_prefix_queries.labels(self._model, executor).inc(report.prefix_queried_tokens)
            self.vllm_prefix_hits.labels(self._model, executor).inc(hits)
        self.bypass_limit.set(report.bypass_limit)
        if report.bypassed:
            self.bypasses.inc(len(report.bypassed))
        if report.max_bypasses > self._max_bypasses_seen:
            self._max_bypasses_seen = report.max_bypasses
            self.max_bypasses_seen.set(report.max_bypasses)
