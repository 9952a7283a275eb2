"""values.schema.json: bad values fail, every value is documented, and the schema agrees with
the CRD and with the operator's settings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.operator.admin import DEFAULT_URL_TEMPLATE
from kvgate.operator.builders.common import RUN_AS_USER
from kvgate.operator.config import OperatorConfig
from tests.chart.helm import Helm
from tests.chart.manifests import CHART, write_values
from tests.chart.value_sets import SASL_SSL_KAFKA
from tests.chart.values_schema import (
    VALUES_SCHEMA_PATH,
    derived_values_schema,
    load_crd,
    render,
)

VALUES_PATH = CHART / "values.yaml"


def _schema() -> dict[str, Any]:
    return dict(json.loads(VALUES_SCHEMA_PATH.read_text()))


def _template(helm: Helm, scratch: Path, name: str, values: dict[str, Any]) -> Any:
    values_file = write_values(scratch, f"bad-{name}", values)
    return helm.run(
        "template",
        "kvgate",
        str(CHART),
        "--namespace",
        "kvgate",
        "--values",
        str(values_file),
        check=False,
    )


# --- bad values fail ----------------------------------------------------------------------------

EXAMPLE_ON = {"examplePool": {"enabled": True}, "kafka": {"bootstrapServers": "kafka:9092"}}

BAD_VALUES: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, values, where helm reports it, what it says)
    ("replicas above one", {"operator": {"replicas": 2}}, "/operator/replicas", "maximum"),
    ("replicas negative", {"operator": {"replicas": -1}}, "/operator/replicas", "minimum"),
    ("replicas as text", {"operator": {"replicas": "one"}}, "/operator/replicas", "want integer"),
    ("replicas as float", {"operator": {"replicas": 0.5}}, "/operator/replicas", "want integer"),
    ("unknown top-level key", {"operatr": {}}, "", "additional properties 'operatr'"),
    ("unknown operator key", {"operator": {"replica": 1}}, "/operator", "'replica'"),
    ("unknown image key", {"images": {"operator": {"name": "x"}}}, "/images/operator", "'name'"),
    ("pull policy", {"images": {"pullPolicy": "Sometimes"}}, "/images/pullPolicy", "one of"),
    ("bad digest", {"images": {"operator": {"digest": "sha256:x"}}}, "/images/operator/digest", ""),
    ("root user", {"operator": {"runAsUser": 0}}, "/operator/runAsUser", "minimum"),
    ("namespace name", {"operator": {"watch": {"namespaces": ["Serving"]}}}, "/namespaces/0", ""),
    ("namespaces as text", {"operator": {"watch": {"namespaces": "x"}}}, "/namespaces", "array"),
    ("poll zero", {"operator": {"settings": {"pollIntervalS": 0}}}, "/pollIntervalS", "exclusive"),
    ("poll large", {"operator": {"settings": {"pollIntervalS": 601}}}, "/pollIntervalS", "maximum"),
    (
        "admin URL placeholder",
        {"operator": {"settings": {"adminUrlTemplate": "http://{name}.svc:8080"}}},
        "/operator/settings/adminUrlTemplate",
        "does not match pattern",
    ),
    ("health port", {"operator": {"healthPort": 80}}, "/operator/healthPort", "minimum"),
    (
        "pdb percentage",
        {"operator": {"podDisruptionBudget": {"maxUnavailable": "150%"}}},
        "/operator/podDisruptionBudget/maxUnavailable",
        "",
    ),
    ("cpu", {"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "/requests/cpu", ""),
    ("scrape interval", {"serviceMonitor": {"interval": "30 seconds"}}, "/interval", "pattern"),
    ("metrics peer empty", {"networkPolicy": {"metricsFrom": [{}]}}, "/metricsFrom/0", "minProp"),
    (
        "policies without namespaces",
        {"operator": {"watch": {"allNamespaces": True}}, "networkPolicy": {"enabled": True}},
        "/networkPolicy/namespaces",
        "minItems",
    ),
    ("gateway model", {"gateway": {"model": "my model"}}, "/gateway/model", "pattern"),
    ("gateway port", {"gateway": {"port": 0}}, "/gateway/port", "minimum"),
    ("gateway unknown key", {"gateway": {"keys": []}}, "/gateway", "'keys'"),
    ("gateway service type", {"gateway": {"service": {"type": "Ingress"}}}, "/type", "one of"),
    (
        "gateway keys secret name",
        {"gateway": {"apiKeys": {"secretName": "Keys!"}}},
        "/gateway/apiKeys/secretName",
        "",
    ),
    ("protocol", {"kafka": {"security": {"protocol": "TLS"}}}, "/security/protocol", "one of"),
    ("bootstrap", {"kafka": {"bootstrapServers": "a:1, b:2"}}, "/kafka/bootstrapServers", ""),
    ("example without kafka", {"examplePool": {"enabled": True}}, "/kafka/bootstrapServers", ""),
    (
        "sasl protocol without sasl",
        {"kafka": {"security": {"protocol": "SASL_SSL"}}},
        "/kafka/security",
        "missing property 'sasl'",
    ),
    (
        "sasl with plaintext",
        {"kafka": {"security": {**SASL_SSL_KAFKA["security"], "protocol": "PLAINTEXT"}}},
        "/kafka/security/sasl",
        "",
    ),
    ("tls with plaintext", {"kafka": {"security": {"tls": {"secretName": "ca"}}}}, "/tls", ""),
    ("create topics as text", {"kafka": {"createTopics": "yes"}}, "/createTopics", "boolean"),
    ("unknown kafka key", {"kafka": {"partitions": 3}}, "/kafka", "'partitions'"),
    ("pool name", {"examplePool": {"name": "Example_Pool"}}, "/examplePool/name", "pattern"),
    (
        "pool executors too many",
        {**EXAMPLE_ON, "examplePool": {"enabled": True, "spec": {"replicas": 2000}}},
        "/examplePool/spec/replicas",
        "maximum",
    ),
    ("pool image twice", {"examplePool": {"spec": {"image": "x"}}}, "/examplePool/spec", "'image'"),
    (
        "pool scheduler setting unknown",
        {"examplePool": {"spec": {"scheduler": {"maxSeqs": 4}}}},
        "/examplePool/spec/scheduler",
        "'maxSeqs'",
    ),
    ("pool dtype", {"examplePool": {"spec": {"model": {"dtype": "int4"}}}}, "/dtype", "one of"),
    (
        "pool memory fraction",
        {"examplePool": {"spec": {"kvCache": {"memoryFraction": 0}}}},
        "/examplePool/spec/kvCache/memoryFraction",
        "exclusiveMinimum",
    ),
    (
        "pool quota zero",
        {"examplePool": {"spec": {"tenants": {"quotas": {"a": {"tokensPerMinute": 0}}}}}},
        "/examplePool/spec/tenants/quotas/a/tokensPerMinute",
        "minimum",
    ),
    (
        "pool quota misspelled",
        {"examplePool": {"spec": {"tenants": {"defaultQuota": {"tokens_per_minute": 5}}}}},
        "/examplePool/spec/tenants/defaultQuota",
        "'tokens_per_minute'",
    ),
]


@pytest.mark.parametrize(
    ("values", "where", "message"),
    [(v, w, m) for _, v, w, m in BAD_VALUES],
    ids=[n for n, _, _, _ in BAD_VALUES],
)
def test_bad_values_are_refused(
    helm: Helm, scratch: Path, values: dict[str, Any], where: str, message: str
) -> None:
    result = _template(helm, scratch, re.sub(r"\W+", "-", where + message)[:60], values)
    assert result.returncode != 0, f"accepted: {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    reported = [line for line in result.stderr.splitlines() if "- at '" in line]
    assert any(
        where in line.split("- at '", 1)[1].split("'", 1)[0] and message in line
        for line in reported
    ), result.stderr


def test_good_neighbours_of_the_bad_values_pass(helm: Helm, scratch: Path) -> None:
    """The limits above are the limits: values just inside them render."""
    values = {
        "operator": {
            "replicas": 0,
            "runAsUser": 1,
            "settings": {"pollIntervalS": 600, "adminUrlTemplate": "https://{pool}.{namespace}"},
            "podDisruptionBudget": {"maxUnavailable": "100%"},
            "resources": {"requests": {"cpu": 0.5, "memory": "1Gi"}},
        },
        "kafka": {
            "bootstrapServers": "a:1,b:2",
            "security": {"protocol": "SSL", "tls": {"secretName": "ca"}},
        },
        "examplePool": {
            "enabled": True,
            "spec": {
                "replicas": 1024,
                "tenants": {"quotas": {"a": {"tokensPerMinute": 1, "burstTokens": 1}}},
            },
        },
    }
    result = _template(helm, scratch, "good-neighbours", values)
    assert result.returncode == 0, result.stderr


# --- the schema agrees with the CRD and the operator ---------------------------------------------


def test_values_schema_follows_the_crd() -> None:
    """The kafka and examplePool.spec schemas are the CRD's (python -m tests.chart.values_schema
    rewrites them after a CRD change)."""
    current = _schema()
    assert VALUES_SCHEMA_PATH.read_text() == render(derived_values_schema(current, load_crd()))


def test_a_crd_change_shows_up_as_a_difference() -> None:
    crd = load_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["replicas"]["maximum"] = 64
    assert derived_values_schema(_schema(), crd) != _schema()


def test_operator_settings_mirror_operator_config() -> None:
    settings = _schema()["properties"]["operator"]["properties"]["settings"]["properties"]
    defaults = yaml.safe_load(VALUES_PATH.read_text())["operator"]["settings"]
    names = {
        "pollIntervalS": "poll_interval_s",
        "resyncIntervalS": "resync_interval_s",
        "maxBackoffS": "max_backoff_s",
        "requestTimeoutS": "request_timeout_s",
    }
    for value_name, field_name in names.items():
        field = OperatorConfig.model_fields[field_name]
        bounds = {
            name: getattr(item, name)
            for item in field.metadata
            for name in ("gt", "ge", "lt", "le")
            if getattr(item, name, None) is not None
        }
        assert settings[value_name]["exclusiveMinimum"] == bounds["gt"], value_name
        assert settings[value_name]["maximum"] == bounds["le"], value_name
        assert defaults[value_name] == field.default, value_name
    assert defaults["adminUrlTemplate"] == DEFAULT_URL_TEMPLATE
    assert set(names) | {"adminUrlTemplate"} == set(settings)
    assert yaml.safe_load(VALUES_PATH.read_text())["operator"]["runAsUser"] == RUN_AS_USER


# --- every value is documented --------------------------------------------------------------------

_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z][A-Za-z0-9]*):")


def undocumented_keys(text: str) -> list[str]:
    """Keys of a values file not directly preceded by a '# -- ...' comment block."""
    lines = text.splitlines()
    missing = []
    for number, line in enumerate(lines):
        match = _KEY.match(line)
        if not match:
            continue
        above = number - 1
        while (
            above >= 0
            and lines[above].strip().startswith("#")
            and not lines[above].strip().startswith("# --")
        ):
            above -= 1
        if above < 0 or not lines[above].strip().startswith("# --"):
            missing.append(f"line {number + 1}: {match['key']}")
    return missing


def _paths(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict) or not node:
        return {prefix} if prefix else set()
    paths = {prefix} if prefix else set()
    for key, value in node.items():
        paths |= _paths(value, f"{prefix}.{key}" if prefix else key)
    return paths


# Schemas derived from the CRD (tests/chart/values_schema.py): their fields are the CRD's.
_CRD_DERIVED = ("kafka", "examplePool.spec", "gateway.kafkaSecurity")


def _schema_paths(node: dict[str, Any], definitions: dict[str, Any], prefix: str = "") -> set[str]:
    """Property paths of the chart's own objects (the CRD-derived parts are documented there)."""
    if "$ref" in node:
        node = definitions[node["$ref"].rsplit("/", 1)[1]]
    paths = {prefix} if prefix else set()
    if prefix in _CRD_DERIVED or node.get("type") != "object":
        return paths
    if "properties" not in node or node.get("additionalProperties") is not False:
        return paths  # a map (labels, requests) or a pass-through Kubernetes object
    for key, child in node["properties"].items():
        paths |= _schema_paths(child, definitions, f"{prefix}.{key}" if prefix else key)
    return paths


def test_every_value_is_documented() -> None:
    assert undocumented_keys(VALUES_PATH.read_text()) == []


def test_the_documentation_check_can_fail() -> None:
    text = "# -- images\nimages:\n  registry: ''\n  # -- documented\n  tag: x\n"
    assert undocumented_keys(text) == ["line 3: registry"]


def test_every_chart_setting_appears_in_values_yaml() -> None:
    schema = _schema()
    declared = _schema_paths(schema, schema["definitions"])
    present = _paths(yaml.safe_load(VALUES_PATH.read_text()))
    assert declared - present == set()
    # ... and every value in values.yaml is declared (helm lint --strict checks it as well).
    chart_owned = {p for p in present if not p.startswith(tuple(f"{d}." for d in _CRD_DERIVED))}
    resource_maps = {p for p in chart_owned if ".resources." in p}
    assert chart_owned - declared - resource_maps == set()
