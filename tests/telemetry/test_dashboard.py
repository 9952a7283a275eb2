"""Every query of the Grafana dashboard the chart ships returns series from a real Prometheus
scraping a real stack.

A real admission service (two ``kvgate sim-executor`` processes behind it, real Kafka) is
scraped as the chart's admission ServiceMonitor says. The stack is driven so that every series
the dashboard reads exists: requests sharing a prompt prefix (prefix-cache hits), more than the
small caches hold at once (preemptions), several tokens each (inter-token latency), a record
the service rejects (rejections). Then each PromQL expression of ``dashboards/kvgate.json``, with
the dashboard's variables filled in as Grafana fills them, is queried until it returns at least
one series; and the model variable's own query finds the served model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvgate.operator.builders.common import PoolRef
from kvgate.operator.naming import admission_name
from tests.admission_service.helpers import request_body
from tests.admission_service.kafka_helpers import Topics, produce, read_results
from tests.chart.helm import Helm
from tests.chart.manifests import render
from tests.chart.test_chart_dashboard import DASHBOARD, dashboard_queries
from tests.chart.value_sets import ValueSet
from tests.harness.kafka import KafkaBroker
from tests.harness.prometheus import Prometheus
from tests.integration.admission_stack import service_settings, start_service, start_sim_executor
from tests.telemetry.service_monitor import admission_scrape_endpoint, static_scrape_config

pytestmark = [
    pytest.mark.observability,
    pytest.mark.kafka,
    pytest.mark.docker,
    pytest.mark.timeout(300),
]

POOL = PoolRef(name="pool-d", namespace="serving", uid="0000-pool-d")
MODEL = "dashboard-model"
SHARED = [(11 * i) % 400 + 1 for i in range(24)]  # a prompt prefix every request starts with
REQUESTS = 12
MONITORING = ValueSet(
    "dashboard-monitoring",
    values={
        "operator": {"watch": {"namespaces": [POOL.namespace]}},
        "serviceMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"},
    },
)


def grafana_fills(expression: str) -> str:
    """The expression as Grafana sends it: every model (``$model`` is a regex, its "All" is
    ``.*``; here the one model) and a rate interval four scrapes long or more."""
    return expression.replace("$model", MODEL).replace("$__rate_interval", "1m")


def test_every_dashboard_query_returns_series(
    kafka_broker: KafkaBroker,
    prometheus_binary: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    chart = render(
        Helm.create(tmp_path_factory.mktemp("helm-home")),
        MONITORING,
        tmp_path_factory.mktemp("values"),
    )
    endpoint = admission_scrape_endpoint(chart, POOL)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [grafana_fills(expr) for expr in dashboard_queries(dashboard)]
    executors = [
        start_sim_executor(tmp_path, name, num_blocks=16, block_size=4, step_time_ms=5)
        for name in ("sim-a", "sim-b")
    ]
    service = None
    try:
        topics = Topics.unique("dashboard")
        settings = service_settings(
            kafka_broker.bootstrap,
            topics,
            executors,
            kafka={"partitions": 1},
            telemetry={"model_name": MODEL},
        )
        service = start_service(tmp_path, "admission", settings)
        scrape = static_scrape_config(
            endpoint,
            [f"127.0.0.1:{service.admin_port}"],
            namespace=POOL.namespace,
            service=admission_name(POOL.name),
        )
        with Prometheus(prometheus_binary, [scrape]) as prometheus:
            prometheus.wait_for(
                f'up{{job="{endpoint.job}"}}', lambda s: [v for _, v in s] == [1.0], timeout_s=60
            )
            bodies = [
                request_body(f"d{i}", prompt=[*SHARED, 100 + i], max_tokens=12)
                for i in range(REQUESTS)
            ]
            bodies.append(request_body("refused", priority=5000))  # outside priority limits
            asyncio.run(produce(kafka_broker.bootstrap, topics.requests, bodies))
            asyncio.run(read_results(kafka_broker.bootstrap, topics.results, len(bodies)))
            assert service.metric("kvgate_admission_preemptions_total") > 0, (
                "the stack must preempt, or the preemption panels have nothing to show"
            )
            empty = []
            for query in queries:
                try:
                    prometheus.wait_for(query, lambda s: len(s) > 0, timeout_s=30)
                except AssertionError:
                    empty.append(query)
            models = prometheus.api(
                "label/model_name/values", **{"match[]": "vllm:num_requests_running"}
            )
    finally:
        if service is not None:
            service.process.stop()
        for executor in executors:
            executor.process.stop()
    assert empty == [], f"dashboard queries with no series: {empty}"
    assert models == [MODEL]
