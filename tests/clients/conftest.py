"""The client libraries users point at an OpenAI-compatible server, against a real stack:
``kvgate run`` (embedded Kafka broker, admission service, a CPU executor, the gateway) serving a
tiny random model with a byte tokenizer and a ChatML template, started once for the package.

The libraries never reach the network: litellm reads its local model-cost map, the Agents SDK
traces nowhere, and every client is built with ``max_retries=0`` (a 4xx is an answer, not a
retry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from tests.gateway.conftest import _env, free_port
from tests.gateway.kvgate_run import kvgate_run

MODEL = "tiny"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Served:
    base_url: str  # .../v1
    root_url: str  # the server root (/tokenize, /detokenize)
    model: str
    model_dir: Path


@pytest.fixture(scope="package")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    out = tmp_path_factory.mktemp("clients")
    model_dir = out / MODEL
    subprocess.run(
        [sys.executable, "-m", "kvgate", "make-tiny-model", str(model_dir)],
        env=_env(), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    port = free_port()
    args = ("--model-dir", str(model_dir), "--gateway-port", str(port), "--port", str(free_port()))
    with kvgate_run(out, *args, env=_env()) as run:
        url = run.banner.openai_url
        assert url == f"http://127.0.0.1:{port}/v1"
        yield Served(url, url.removesuffix("/v1"), MODEL, model_dir)
