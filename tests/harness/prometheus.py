"""A real Prometheus for tests, built from Go modules.

``prometheus/go.mod`` names ``github.com/prometheus/prometheus`` v0.316.0 (Prometheus 3.16.0;
its Go module is tagged v0.3xx) as a ``tool``; the harness builds its ``cmd/prometheus``, the
program the project releases, with the tags ``remove_all_sd,enable_kubernetes_sd``: every
service discovery but the built-in ones (static, file, HTTP) and Kubernetes' left out. The web
UI's assets are not embedded (``builtinassets`` unset): the HTTP API is all a test needs.

Built once per recipe into ``<cache>/prometheus/bin-<hash>/prometheus`` (``go_build.py``):
about 6.7 CPU-minutes cold (10 min wall on a busy 2-core machine, 1.3 GB peak memory, 3.2 GB of
module and build caches), a relink of seconds warm; 76 MB.

:class:`Prometheus` runs it on 127.0.0.1 with a generated configuration and a private TSDB
directory, and queries it through ``/api/v1``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.harness.daemon import Daemon
from tests.harness.go_build import GoRecipe, build_recipe
from tests.harness.system import HarnessError, Progress, free_port, log_progress

RECIPE_DIR = Path(__file__).with_name("prometheus")
VERSION = "3.16.0"  # the module's VERSION file; its Go module is tagged v0.316.0
_PACKAGE = "github.com/prometheus/prometheus/cmd/prometheus"
_READY_TIMEOUT_S = 60

#: One sample of an instant query: its labels and its value.
Sample = tuple[dict[str, str], float]


def recipe() -> GoRecipe:
    return GoRecipe(
        name="prometheus",
        directory=RECIPE_DIR,
        files=("go.mod", "go.sum"),
        package=_PACKAGE,
        binary="prometheus",
        tags=("remove_all_sd", "enable_kubernetes_sd"),
        # What the project's release build stamps (`prometheus --version`, build_info).
        ldflags=f"-s -w -X github.com/prometheus/common/version.Version={VERSION}",
    )


def build(progress: Progress = log_progress) -> Path:
    """The Prometheus binary for the current recipe, built on first use."""
    return build_recipe(recipe(), progress, cold_estimate="about 10 CPU-minutes")


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, body.decode(errors="replace")


class Prometheus:
    """One running Prometheus (a context manager) scraping ``scrape_configs``.

    ``scrape_configs`` are Prometheus ``scrape_config`` mappings, written as given under a
    ``global`` section that scrapes and evaluates every ``interval``.
    """

    def __init__(
        self,
        binary: Path,
        scrape_configs: Sequence[dict[str, Any]],
        *,
        interval: str = "1s",
        progress: Progress = log_progress,
    ) -> None:
        self.binary = binary
        self.config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": list(scrape_configs),
        }
        self._daemon = Daemon("prometheus", progress)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        workdir = self._daemon.workdir
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self._daemon.progress(f"starting Prometheus on {self.url}; log: {self._daemon.log_path}")
        self._daemon.start(
            [
                str(self.binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ]
        )
        try:
            self._daemon.wait_until(self._ready, timeout_s=_READY_TIMEOUT_S, what="/-/ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        self._daemon.stop()

    def log(self) -> str:
        return self._daemon.log()

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``; the ``data`` of a success, HarnessError otherwise."""
        query = urllib.parse.urlencode(params)
        status, body = _get(f"{self.url}/api/v1/{path}{'?' + query if query else ''}")
        if status != 200 or not isinstance(body, dict) or body.get("status") != "success":
            raise HarnessError(f"Prometheus /api/v1/{path} {params}: HTTP {status}: {body}")
        return body["data"]

    def query(self, expression: str) -> list[Sample]:
        """An instant query whose result is a vector: (labels, value) per series."""
        data = self.api("query", query=expression)
        if data["resultType"] != "vector":
            raise HarnessError(f"{expression!r} gave a {data['resultType']}, not a vector")
        return [(dict(item["metric"]), float(item["value"][1])) for item in data["result"]]

    def active_targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return targets

    def wait_for(
        self, expression: str, condition: Callable[[list[Sample]], bool], *, timeout_s: float
    ) -> list[Sample]:
        """Query ``expression`` until ``condition`` holds for its result."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.query(expression)
            if condition(samples):
                return samples
            if time.monotonic() > deadline:
                targets = [
                    (t["scrapeUrl"], t["health"], t["lastError"]) for t in self.active_targets()
                ]
                raise AssertionError(
                    f"timed out after {timeout_s:.0f} s waiting on {expression!r}: {samples}; "
                    f"targets: {targets}\nPrometheus log:\n{self.log()}"
                )
            time.sleep(0.2)
