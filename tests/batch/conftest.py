"""Fixtures of the batch tests: a real S3-compatible store (versitygw, built from Go modules
by the harness on first use; tests that use it are marked ``s3`` and skip, with the reason,
where Go is missing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import versitygw
from tests.harness.go_build import GoMissing
from tests.harness.system import progress_to


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def s3_server(pytestconfig: pytest.Config) -> Iterator[versitygw.S3Server]:
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    try:
        binary = versitygw.build(progress_to(reporter, "kvgate harness"))
    except GoMissing as exc:
        pytest.skip(str(exc))
    with versitygw.S3Server(binary) as server:
        yield server
