"""A real Prometheus (built from Go modules, ``tests/harness/prometheus.py``) scrapes a real
admission service as the chart's ServiceMonitor tells it to, and answers PromQL over what the
service did.

The scrape config comes from the rendered chart (``serviceMonitor.enabled``): its admission
ServiceMonitor is followed through the Service and pod template the operator builds to the
container port the service listens on (``service_monitor.py``), so a chart or operator change
that breaks scraping (a renamed port, a selector that no longer matches) fails here. The stack
(``kvgate admission-service`` and a ``kvgate sim-executor`` against real Kafka) then serves
requests, and the test queries ``/api/v1/query``: ``up``, the admission counters, and the
time-to-first-token histogram through ``histogram_quantile`` over its ``_bucket`` series.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from kvgate.operator.builders.admission import (
    build_admission_config,
    build_admission_deployment,
    build_admission_service,
)
from kvgate.operator.builders.common import PoolRef
from kvgate.operator.models import parse_spec
from kvgate.operator.naming import admission_name
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.chart.helm import Helm
from tests.chart.manifests import render
from tests.chart.value_sets import ValueSet
from tests.harness.kafka import KafkaBroker
from tests.harness.kube_apiserver import GoMissing
from tests.harness.prometheus import Prometheus, build
from tests.harness.system import progress_to
from tests.integration.admission_stack import service_settings, start_service, start_sim_executor
from tests.operator.examples import FULL_SPEC
from tests.reliability.processes import parse_metrics
from tests.telemetry.service_monitor import ScrapeEndpoint, resolve, static_scrape_config

pytestmark = [
    pytest.mark.observability,
    pytest.mark.kafka,
    pytest.mark.docker,
    pytest.mark.timeout(300),
]

POOL = PoolRef(name="pool-a", namespace="serving", uid="0000-pool-a")
MODEL = "llama-3.2-1b-test"
REQUESTS = 6
TTFT = "kvgate_admission_time_to_first_token_seconds"
# The chart's ServiceMonitors with a scrape interval a test can wait for.
MONITORING = ValueSet(
    "monitoring",
    values={
        "operator": {"watch": {"namespaces": [POOL.namespace]}},
        "serviceMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"},
    },
)


@pytest.fixture(scope="module")
def prometheus_binary(pytestconfig: pytest.Config) -> Path:
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    try:
        return build(progress_to(reporter, "kvgate harness"))
    except GoMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def admission_endpoint(tmp_path_factory: pytest.TempPathFactory) -> ScrapeEndpoint:
    """The chart's admission ServiceMonitor, resolved through the operator's objects."""
    helm = Helm.create(tmp_path_factory.mktemp("helm-home"))
    rendered = render(helm, MONITORING, tmp_path_factory.mktemp("values"))
    monitor = rendered.one("ServiceMonitor", "kvgate-admission")
    spec = parse_spec(POOL.name, FULL_SPEC)
    deployment = build_admission_deployment(POOL, spec, image="a:1", admin_token="t")
    endpoint = resolve(
        monitor, build_admission_service(POOL), deployment["spec"]["template"]["spec"]
    )
    # The port the pod's admission service is configured to listen on is the one scraped.
    assert endpoint.container_port == build_admission_config(POOL, spec)["admin"]["port"]
    assert (endpoint.path, endpoint.interval, endpoint.timeout) == ("/metrics", "1s", "1s")
    return endpoint


def _bucket_bounds(text: str, quantile: float) -> tuple[float, float]:
    """The (lower, upper] bucket of the service's own TTFT histogram the quantile falls in."""
    samples = parse_metrics(text)
    counts: dict[float, float] = {}
    for head, value in samples.items():
        if head.startswith(f"{TTFT}_bucket{{"):
            le = head.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + value
    bounds = sorted(counts)
    rank = quantile * counts[math.inf]
    lower = 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            return lower, bound
        lower = bound
    raise AssertionError(f"no bucket holds rank {rank}: {counts}")


def test_prometheus_scrapes_the_admission_service_as_the_chart_says(
    kafka_broker: KafkaBroker,
    prometheus_binary: Path,
    admission_endpoint: ScrapeEndpoint,
    tmp_path: Path,
) -> None:
    executor = start_sim_executor(tmp_path, "sim-0", num_blocks=64, block_size=4, step_time_ms=5)
    service = None
    try:
        topics = Topics.unique("prometheus")
        settings = service_settings(
            kafka_broker.bootstrap,
            topics,
            [executor],
            kafka={"partitions": 1},
            telemetry={"model_name": MODEL},
        )
        service = start_service(tmp_path, "admission", settings)
        scrape = static_scrape_config(
            admission_endpoint,
            [f"127.0.0.1:{service.admin_port}"],  # stands in for <pod IP>:<container port>
            namespace=POOL.namespace,
            service=admission_name(POOL.name),
        )
        with Prometheus(prometheus_binary, [scrape]) as prometheus:
            selector = f'job="{admission_endpoint.job}",namespace="serving"'
            prometheus.wait_for(
                f"up{{{selector}}}", lambda s: [v for _, v in s] == [1.0], timeout_s=60
            )
            bodies = [
                request_body(f"r{i}", prompt_len=5 + i, max_tokens=6) for i in range(REQUESTS)
            ]
            asyncio.run(produce(kafka_broker.bootstrap, topics.requests, bodies))
            asyncio.run(read_results(kafka_broker.bootstrap, topics.results, REQUESTS))
            completed = f'kvgate_admission_results_total{{{selector},status="completed"}}'
            prometheus.wait_for(completed, lambda s: [v for _, v in s] == [REQUESTS], timeout_s=60)
            prometheus.wait_for(
                f"{TTFT}_count{{{selector}}}", lambda s: sum(v for _, v in s) == REQUESTS,
                timeout_s=60,
            )  # fmt: skip
            received = prometheus.query(f"kvgate_admission_requests_received_total{{{selector}}}")
            steps = prometheus.query(f"sum(kvgate_admission_steps_total{{{selector}}})")
            [(labels, p50)] = prometheus.query(
                f"histogram_quantile(0.5, sum by (le, model) ({TTFT}_bucket{{{selector}}}))"
            )
            own_histogram = service.metrics()
    finally:
        if service is not None:
            service.process.stop()
        executor.process.stop()

    assert [v for _, v in received] == [REQUESTS]
    assert steps[0][1] > 0
    assert labels == {"model": MODEL}
    # Prometheus interpolates within the bucket the median falls in, by the service's own counts.
    lower, upper = _bucket_bounds(own_histogram, 0.5)
    assert lower <= p50 <= upper, (p50, lower, upper)
    assert 0.0 < p50 < math.inf
