"""Fixtures for the chart tests: one helm (extracted once per machine) and each value set
rendered once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chart.helm import Helm
from tests.chart.manifests import Rendered, render
from tests.chart.value_sets import BY_NAME, VALUE_SETS


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm.create(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart-values")


@pytest.fixture(scope="session")
def rendered_sets(helm: Helm, scratch: Path) -> dict[str, Rendered]:
    return {value_set.name: render(helm, value_set, scratch) for value_set in VALUE_SETS}


@pytest.fixture(params=[value_set.name for value_set in VALUE_SETS])
def rendered(request: pytest.FixtureRequest, rendered_sets: dict[str, Rendered]) -> Rendered:
    """The chart rendered with each value set in turn."""
    return rendered_sets[request.param]


def rendered_set(rendered_sets: dict[str, Rendered], name: str) -> Rendered:
    assert name in BY_NAME, name
    return rendered_sets[name]
