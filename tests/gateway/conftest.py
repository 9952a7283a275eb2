"""Real processes on 127.0.0.1: ``kvgate run --model-dir TINY --no-gateway`` (embedded broker,
the tiny real executor, the admission service) and ``kvgate gateway`` replicas in front of it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.gateway.kvgate_run import kvgate_run, stop_process

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
FULL_KEY = "sk-full-0123456789abcdef"
LIMITED_KEY = "sk-limited-0123456789abcdef"
SLOW_KEY = "sk-slow-0123456789abcdef"
# A template in the shape of ChatML, enough to render a conversation for the tiny model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def record_id(key: str, tenant: str = "full") -> str:
    """The record id the gateway gives an idempotency key (header or ``request_id``) of a tenant:
    the key, ``@`` and 16 hex digits of the tenant's SHA-256 (docs/gateway.md); "full" is the
    tenant of ``FULL_KEY`` (its key's name)."""
    return f"{key}@{hashlib.sha256(tenant.encode()).hexdigest()[:16]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    return env | {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true"}


def _wait_for(what: str, check: object, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited: {log.read_text()[-3000:]}")
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not ready in time: {log.read_text()[-3000:]}")


@dataclass
class Stack:
    bootstrap: str
    model_dir: Path
    out_dir: Path


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    out = tmp_path_factory.mktemp("stack")
    model_dir = out / "model"
    subprocess.run(
        [sys.executable, "-m", "kvgate", "make-tiny-model", str(model_dir)],
        env=_env(), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    port = free_port()
    # The banner: the executor's session is open (the tests' first requests run at once).
    with kvgate_run(
        out, "--port", str(port), "--model-dir", str(model_dir), "--no-gateway", env=_env()
    ):
        yield Stack(f"127.0.0.1:{port}", model_dir, out)


@dataclass
class GatewayProcess:
    port: int
    health_port: int
    replica_id: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        stop_process(self.process)


def start_gateway(stack: Stack, replica_id: str, *extra: str) -> GatewayProcess:
    keys = stack.out_dir / "keys.yaml"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"name": "full", "key": FULL_KEY, "min_priority": -10},
                    {"name": "limited", "key": LIMITED_KEY, "min_priority": 5},
                    {"name": "slow", "key": SLOW_KEY, "requests_per_s": 0.01, "burst": 1},
                ]
            }
        )
    )
    port, health_port = free_port(), free_port()
    log = stack.out_dir / f"gateway-{replica_id}.log"
    with log.open("ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "gateway", "--bootstrap", stack.bootstrap,
             "--port", str(port), "--health-port", str(health_port), "--replica-id", replica_id,
             "--model", MODEL, "--tokenizer", str(stack.model_dir / "tokenizer.json"),
             "--api-keys-file", str(keys), *extra],
            env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz") as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    _wait_for(f"gateway {replica_id}", ready, process, log)
    return GatewayProcess(port, health_port, replica_id, process, log)


@pytest.fixture(scope="package")
def gateway(stack: Stack) -> Iterator[GatewayProcess]:
    running = start_gateway(stack, "gw-a")
    yield running
    running.stop()
