"""The README's OpenAI example as written: ``kvgate run --smollm2 --gateway`` (real processes on
loopback) answered through the official ``openai`` client, compared with transformers' greedy
generation from its own reading of the same GGUF file."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI

from tests.gateway.conftest import _env, _stop, _wait_for, free_port

pytestmark = pytest.mark.timeout(300)
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def running(out: Path, *extra: str) -> Iterator[OpenAI]:
    """``kvgate run --smollm2 --gateway [extra]`` on loopback, and an ``openai`` client for it."""
    log = out / "run.log"
    port = free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "run", "--smollm2", "--gateway", "--gateway-port",
             str(port), "--port", str(free_port()), "--out-dir", str(out), *extra],
            env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_for("kvgate run", lambda: b"OpenAI API" in log.read_bytes(), process, log)
        printed = re.search(rb"OpenAI API +(\S+)", log.read_bytes())
        assert printed is not None
        assert printed.group(1).decode() == f"http://127.0.0.1:{port}/v1"
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def client(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    with running(tmp_path_factory.mktemp("run-smollm2")) as served:
        yield served


def greedy(hf_model: Any, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=eos,
        )  # fmt: skip
    new = out[0, len(ids) :].tolist()
    return new[: new.index(eos)] if eos in new else new


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_greedy_completion_equals_transformers(
    client: OpenAI, hf_model: Any, hf_tokenizer: Any
) -> None:
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(ids)
    reference = greedy(hf_model, ids, 12, hf_tokenizer.eos_token_id)
    assert answer.choices[0].text == hf_tokenizer.decode(reference)
    assert answer.usage.completion_tokens == len(reference) + (
        1 if answer.choices[0].finish_reason == "stop" else 0
    )


def test_streamed_chat_equals_the_whole_answer_and_transformers(
    client: OpenAI, hf_model: Any, hf_tokenizer: Any
) -> None:
    messages: list[Any] = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    text = whole.choices[0].message.content
    assert "".join(pieces) == text
    rendered = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    reference = greedy(hf_model, ids, 24, hf_tokenizer.eos_token_id)
    assert text == hf_tokenizer.decode(reference)
