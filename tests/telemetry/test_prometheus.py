"""A real Prometheus (built from Go modules, ``tests/harness/prometheus.py``) scrapes a real
admission service and a real gateway as the chart's ServiceMonitors tell it to, and answers
PromQL over what they did.

The scrape configs come from the rendered chart (``serviceMonitor.enabled``, the gateway on):
the admission ServiceMonitor is followed through the Service and pod template the operator
builds, the gateway's through the chart's own headless Service and StatefulSet, each to the
container port the process is configured to listen on (``service_monitor.py``), so a chart or
operator change that breaks scraping (a renamed port, a selector that no longer matches) fails
here. The stack (``kvgate admission-service``, a ``kvgate sim-executor`` and ``kvgate gateway``
against real Kafka) then serves requests, some written to Kafka directly and some through the
gateway, and the test queries ``/api/v1/query``: ``up``, the admission and gateway counters, and
the time-to-first-token histograms through ``histogram_quantile`` over their ``_bucket`` series.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate.operator.builders.common import PoolRef
from kvgate.operator.naming import admission_name
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.chart.helm import Helm
from tests.chart.manifests import Rendered, render
from tests.chart.value_sets import ValueSet
from tests.harness.kafka import KafkaBroker
from tests.harness.prometheus import Prometheus
from tests.integration.admission_stack import (
    GATEWAY_KEY,
    service_settings,
    start_gateway,
    start_service,
    start_sim_executor,
)
from tests.reliability.processes import parse_metrics
from tests.telemetry.service_monitor import (
    ScrapeEndpoint,
    admission_scrape_endpoint,
    gateway_scrape_endpoint,
    static_scrape_config,
)

pytestmark = [
    pytest.mark.observability,
    pytest.mark.kafka,
    pytest.mark.docker,
    pytest.mark.timeout(300),
]

POOL = PoolRef(name="pool-a", namespace="serving", uid="0000-pool-a")
MODEL = "llama-3.2-1b-test"
REQUESTS = 6  # written to Kafka directly
GATEWAY_REQUESTS = 2  # through the gateway: one plain, one streamed
TTFT = "kvgate_admission_time_to_first_token_seconds"
GATEWAY_TTFT = "kvgate_gateway_time_to_first_token_seconds"
# The chart's ServiceMonitors with a scrape interval a test can wait for, the gateway on.
MONITORING = ValueSet(
    "monitoring",
    values={
        "operator": {"watch": {"namespaces": [POOL.namespace]}},
        "serviceMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"},
        "kafka": {"bootstrapServers": "kafka:9092"},
        "gateway": {
            "enabled": True,
            "namespace": POOL.namespace,
            "model": MODEL,
            "allowAnonymous": True,
        },
    },
)


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    helm = Helm.create(tmp_path_factory.mktemp("helm-home"))
    return render(helm, MONITORING, tmp_path_factory.mktemp("values"))


@pytest.fixture(scope="module")
def admission_endpoint(chart: Rendered) -> ScrapeEndpoint:
    endpoint = admission_scrape_endpoint(chart, POOL)
    assert (endpoint.path, endpoint.interval, endpoint.timeout) == ("/metrics", "1s", "1s")
    return endpoint


@pytest.fixture(scope="module")
def gateway_endpoint(chart: Rendered) -> ScrapeEndpoint:
    return gateway_scrape_endpoint(chart)


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


async def _through_the_gateway(port: int) -> None:
    api = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY, max_retries=0
    )
    request: dict[str, Any] = {
        "model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    done = await api.completions.create(**request)
    assert done.usage is not None and done.usage.completion_tokens == 4
    chunks = await api.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage.completion_tokens async for chunk in chunks if chunk.usage is not None]
    assert usage == [4]
    await api.close()


def _values(samples: list[tuple[dict[str, str], float]]) -> list[float]:
    return [value for _, value in samples]


def test_prometheus_scrapes_the_admission_service_and_gateway_as_the_chart_says(
    kafka_broker: KafkaBroker,
    prometheus_binary: Path,
    admission_endpoint: ScrapeEndpoint,
    gateway_endpoint: ScrapeEndpoint,
    tmp_path: Path,
) -> None:
    executor = start_sim_executor(tmp_path, "sim-0", num_blocks=64, block_size=4, step_time_ms=5)
    service = gateway = None
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
        gateway = start_gateway(tmp_path, kafka_broker.bootstrap, topics, "gw-0", model=MODEL)
        scrapes = [  # each target stands in for <pod IP>:<container port>
            static_scrape_config(
                admission_endpoint,
                [f"127.0.0.1:{service.admin_port}"],
                namespace=POOL.namespace,
                service=admission_name(POOL.name),
            ),
            static_scrape_config(
                gateway_endpoint,
                [f"127.0.0.1:{gateway.health_port}"],
                namespace=POOL.namespace,
                service="kvgate-gateway-pods",
            ),
        ]
        with Prometheus(prometheus_binary, scrapes) as prometheus:
            admission = f'job="{admission_endpoint.job}",namespace="serving"'
            front = f'job="{gateway_endpoint.job}",namespace="serving"'
            for selector in (admission, front):
                prometheus.wait_for(
                    f"up{{{selector}}}", lambda s: _values(s) == [1.0], timeout_s=60
                )
            bodies = [
                request_body(f"r{i}", prompt_len=5 + i, max_tokens=6) for i in range(REQUESTS)
            ]
            asyncio.run(produce(kafka_broker.bootstrap, topics.requests, bodies))
            asyncio.run(read_results(kafka_broker.bootstrap, topics.results, REQUESTS))
            asyncio.run(_through_the_gateway(gateway.port))
            total = REQUESTS + GATEWAY_REQUESTS
            completed = f'kvgate_admission_results_total{{{admission},status="completed"}}'
            prometheus.wait_for(completed, lambda s: _values(s) == [total], timeout_s=60)
            prometheus.wait_for(
                f"sum({TTFT}_count{{{admission}}})", lambda s: _values(s) == [total], timeout_s=60
            )
            prometheus.wait_for(
                f"sum(kvgate_gateway_requests_total{{{front}}})",
                lambda s: _values(s) == [GATEWAY_REQUESTS],
                timeout_s=60,
            )
            prometheus.wait_for(
                f"sum({GATEWAY_TTFT}_count{{{front}}})", lambda s: _values(s) == [1], timeout_s=60
            )  # the streamed request
            received = prometheus.query(f"kvgate_admission_requests_received_total{{{admission}}}")
            steps = prometheus.query(f"sum(kvgate_admission_steps_total{{{admission}}})")
            [(labels, p50)] = prometheus.query(
                f"histogram_quantile(0.5, sum by (le, model) ({TTFT}_bucket{{{admission}}}))"
            )
            [(gateway_labels, gateway_p50)] = prometheus.query(
                f"histogram_quantile(0.5, sum by (le, model) ({GATEWAY_TTFT}_bucket{{{front}}}))"
            )
            own_histogram = service.metrics()
    finally:
        for process in (gateway, service):
            if process is not None:
                process.process.stop()
        executor.process.stop()

    assert _values(received) == [total]
    assert steps[0][1] > 0
    assert labels == {"model": MODEL} and gateway_labels == {"model": MODEL}
    # Prometheus interpolates within the bucket the median falls in, by the service's own counts.
    lower, upper = _bucket_bounds(own_histogram, 0.5)
    assert lower <= p50 <= upper, (p50, lower, upper)
    assert 0.0 < p50 < math.inf
    assert 0.0 < gateway_p50 < math.inf
