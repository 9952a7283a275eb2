"""Rendering the chart and reading what came out: documents by kind, label selectors, rules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.chart.helm import Helm
from tests.chart.value_sets import ValueSet

CHART = Path(__file__).parents[2] / "charts" / "kvgate"
# The newest Kubernetes kubernetes-validate knows; rendered manifests must be valid there.
KUBERNETES_VERSION = "1.37.0"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Rendered:
    value_set: ValueSet
    documents: tuple[Manifest, ...]

    def of_kind(self, kind: str) -> list[Manifest]:
        return [doc for doc in self.documents if doc["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> Manifest:
        found = [d for d in self.of_kind(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def operator(self) -> Manifest:
        """The operator's Deployment (the batch feeder, when deployed, is another one)."""
        found = [
            d
            for d in self.of_kind("Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
        ]
        assert len(found) == 1, f"expected one operator Deployment, found {len(found)}"
        return found[0]


def write_values(directory: Path, name: str, values: Mapping[str, Any]) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(values), sort_keys=False))
    return path


def template_args(value_set: ValueSet, values_file: Path) -> list[str]:
    return [
        "template",
        value_set.release,
        str(CHART),
        "--namespace",
        value_set.namespace,
        "--kube-version",
        KUBERNETES_VERSION,
        "--values",
        str(values_file),
    ]


def render(helm: Helm, value_set: ValueSet, scratch: Path) -> Rendered:
    values_file = write_values(scratch, value_set.name, value_set.values)
    output = helm.run(*template_args(value_set, values_file)).stdout
    documents = tuple(doc for doc in yaml.safe_load_all(output) if doc)
    return Rendered(value_set, documents)


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects ``labels``."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


Permission = tuple[str, str, str]  # (API group, resource, verb)


def permissions(rules: Iterable[Mapping[str, Any]]) -> set[Permission]:
    """Every (group, resource, verb) a list of PolicyRules grants, wildcards kept literally."""
    granted: set[Permission] = set()
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    granted.add((group, resource, verb))
    return granted


def wildcards(rules: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every '*' in a list of PolicyRules, and any nonResourceURLs or resourceNames escape."""
    found = []
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs", "nonResourceURLs"):
            found += [f"{key}: {item}" for item in rule.get(key, []) if "*" in item]
        if "nonResourceURLs" in rule:
            found.append(f"nonResourceURLs: {rule['nonResourceURLs']}")
    return found
