"""Real processes for the admission-service integration tests: ``kvgate sim-executor`` servers
and ``kvgate admission-service`` instances on 127.0.0.1, with their settings files and logs.

Everything waits by polling with a deadline; a process that dies while being waited for fails
the wait with the tail of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.admission_service.kafka_helpers import Topics

REPO = Path(__file__).resolve().parents[2]
EXECUTOR_TOKEN = "integration-executor-token"
ADMIN_TOKEN = "integration-admin-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env |= {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true", "PYTHONUNBUFFERED": "1"}
    return env | (extra or {})


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout_s:.0f} s; log:\n{self.log_tail()}"
            ) from None

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time (test teardown)."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Process:
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as sink:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvgate", *argv],
            cwd=REPO,
            env=_env(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    return Process(name, popen, log_path)


def wait_http(process: Process, url: str, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if not process.alive:
            raise AssertionError(
                f"{process.name} exited ({process.popen.returncode}):\n{process.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not ready after {timeout_s:.0f} s:\n{process.log_tail()}")
        time.sleep(0.1)


@dataclass
class SimExecutor:
    process: Process
    port: int

    @property
    def endpoint(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/steps"


def start_sim_executor(
    log_dir: Path, name: str, *, port: int | None = None, **options: Any
) -> SimExecutor:
    port = port or free_port()
    token_file = log_dir / "executor-token"
    token_file.write_text(EXECUTOR_TOKEN)
    argv = [
        "sim-executor",
        "--port",
        str(port),
        "--executor-id",
        name,
        "--token-file",
        str(token_file),
    ]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    process = spawn(name, argv, log_dir)
    wait_http(process, f"http://127.0.0.1:{port}/readyz")
    return SimExecutor(process, port)


@dataclass
class Service:
    process: Process
    admin_port: int
    config_path: Path
    settings: dict[str, Any] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin_port}{path}"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as response:
            return str(response.read().decode())

    def scrape(self) -> dict[str, float]:
        """One scrape: each metric name -> the sum of its samples (all label sets)."""
        totals: dict[str, float] = {}
        for line in self.metrics().splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            name = head.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def metric(self, name: str) -> float:
        return self.scrape().get(name, 0.0)

    def put_members(self, members: list[dict[str, Any]]) -> None:
        body = json.dumps({"executors": members}).encode()
        request = urllib.request.Request(
            self.url("/v1/executors"),
            data=body,
            method="PUT",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200


def service_settings(
    bootstrap: str, topics: Topics, executors: list[SimExecutor], **sections: Any
) -> dict[str, Any]:
    kafka_defaults = {
        "partitions": 4,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
        "commit_interval_ms": 50,
    }
    kafka = topics.kafka_settings(bootstrap, **(kafka_defaults | sections.pop("kafka", {})))
    return {
        "kafka": kafka,
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "prefill_chunk_size": 32}
        | sections.pop("scheduler", {}),
        "admin": {"host": "127.0.0.1", "port": free_port(), "token": ADMIN_TOKEN},
        "executors": {
            "token": EXECUTOR_TOKEN,
            "members": [{"name": e.process.name, "endpoint": e.endpoint} for e in executors],
            "reconnect_initial_s": 0.1,
            "reconnect_max_s": 1.0,
            "heartbeat_s": 2.0,
            "step_timeout_s": 20.0,
        }
        | sections.pop("executors", {}),
        **sections,
    }


def start_service(
    log_dir: Path,
    name: str,
    settings: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
) -> Service:
    config = log_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(settings))
    process = spawn(name, ["admission-service", "--config", str(config)], log_dir, env)
    service = Service(process, int(settings["admin"]["port"]), config, settings)
    if wait_ready:
        wait_http(process, service.url("/readyz"))
    return service


GATEWAY_KEY = "sk-integration-0123456789"


@dataclass
class Gateway:
    process: Process
    port: int  # the OpenAI-compatible API (needs GATEWAY_KEY)
    health_port: int  # /healthz, /readyz and /metrics without a key


def start_gateway(
    log_dir: Path,
    bootstrap: str,
    topics: Topics,
    replica: str,
    *,
    model: str = "sim",
    extra: tuple[str, ...] = (),
) -> Gateway:
    """``kvgate gateway`` over ``topics`` serving ``model``, its one key ``GATEWAY_KEY``;
    ``extra``: more of its flags (Kafka security, HTTP limits)."""
    keys = log_dir / "keys.yaml"
    keys.write_text(json.dumps({"keys": [{"name": "it", "key": GATEWAY_KEY}]}))
    port, health = free_port(), free_port()
    argv = [
        "gateway", "--bootstrap", bootstrap, "--port", str(port),
        "--health-port", str(health), "--replica-id", replica, "--model", model,
        "--request-topic", topics.requests, "--result-topic", topics.results,
        "--abort-topic", topics.aborts, "--api-keys-file", str(keys), *extra,
    ]  # fmt: skip
    process = spawn(replica, argv, log_dir)
    wait_http(process, f"http://127.0.0.1:{health}/readyz")
    return Gateway(process, port, health)
