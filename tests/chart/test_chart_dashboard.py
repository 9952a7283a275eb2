"""The Grafana dashboard the chart ships: a ConfigMap the dashboard sidecar finds by its label,
holding the dashboard JSON whose every panel has a PromQL query (each query is run against a
real Prometheus in tests/telemetry/test_dashboard.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.chart.helm import Helm
from tests.chart.manifests import CHART, Rendered, render, write_values
from tests.chart.value_sets import ValueSet

DASHBOARD = CHART / "dashboards" / "kvgate.json"


def dashboard_queries(dashboard: dict[str, object]) -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows hold none)."""
    panels = dashboard["panels"]
    assert isinstance(panels, list)
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_the_dashboard_ships_as_a_configmap_the_sidecar_finds(
    rendered_sets: dict[str, Rendered],
) -> None:
    config_map = rendered_sets["defaults"].one("ConfigMap", "kvgate-dashboards")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["kvgate.json"])
    assert shipped == json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(shipped)
    assert len(queries) >= 20
    names = " ".join(queries)
    for vllm_name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ):
        assert vllm_name in names, vllm_name


def test_the_label_namespace_and_switch_are_values(helm: Helm, scratch: Path) -> None:
    custom = render(
        helm,
        ValueSet(
            "dashboards-custom",
            values={
                "dashboards": {
                    "namespace": "monitoring",
                    "sidecarLabel": "kvgate.dev/dashboard",
                    "sidecarLabelValue": "yes",
                    "annotations": {"grafana_folder": "Serving"},
                }
            },
        ),
        scratch,
    )
    config_map = custom.one("ConfigMap", "kvgate-dashboards")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["kvgate.dev/dashboard"] == "yes"
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Serving"}
    off = render(
        helm, ValueSet("dashboards-off", values={"dashboards": {"enabled": False}}), scratch
    )
    assert not [m for m in off.of_kind("ConfigMap") if m["metadata"]["name"] == "kvgate-dashboards"]


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"sidecarLabel": ""}, "/dashboards/sidecarLabel"),
        ({"sidecarLabel": "grafana dashboard"}, "/dashboards/sidecarLabel"),
        ({"namespace": "Monitoring"}, "/dashboards/namespace"),
        ({"sidecarLabelValue": 1}, "/dashboards/sidecarLabelValue"),
        ({"folder": "Serving"}, "/dashboards"),
    ],
    ids=["empty label", "label with a space", "namespace not DNS-1123", "value not text", "typo"],
)
def test_bad_dashboard_values_are_refused(
    helm: Helm, scratch: Path, values: dict[str, Any], where: str
) -> None:
    name = "bad-dashboards-" + "-".join(values)
    values_file = write_values(scratch, name, {"dashboards": values})
    result = helm.run("template", "kvgate", str(CHART), "--values", str(values_file), check=False)
    assert result.returncode != 0, f"accepted: {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert f"- at '{where}'" in result.stderr, result.stderr
