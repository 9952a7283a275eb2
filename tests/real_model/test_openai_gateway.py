"""The README's OpenAI example: plain ``kvgate run`` (no model flag, no door flag; only its ports
and output directory chosen, as tests share the machine) serves the packaged SmolLM2 over the
OpenAI API on loopback. Answered through the official ``openai`` client and compared with
transformers' greedy generation from its own reading of the same GGUF file; its banner is
printed once, after every address it names answers; a healthy start logs no warning."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI

from tests.gateway.conftest import _env, free_port
from tests.gateway.kvgate_run import RunProcess, kvgate_run

pytestmark = pytest.mark.timeout(300)
MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def running(out: Path, *extra: str) -> Iterator[tuple[RunProcess, OpenAI]]:
    """``kvgate run [extra]`` on loopback, and an ``openai`` client for its printed URL."""
    port = free_port()
    args = ("--gateway-port", str(port), "--port", str(free_port()), *extra)
    with kvgate_run(out, *args, env=_env()) as run:
        assert run.banner.openai_url == f"http://127.0.0.1:{port}/v1"
        print(f"kvgate run: banner {run.started_to_banner_s:.1f} s after the start")
        yield run, OpenAI(base_url=run.banner.openai_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunProcess, OpenAI]]:
    with running(tmp_path_factory.mktemp("run-default")) as started:
        yield started


@pytest.fixture(scope="module")
def client(served: tuple[RunProcess, OpenAI]) -> OpenAI:
    return served[1]


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


def test_the_banner_is_printed_once_after_every_address_in_it_answers(
    served: tuple[RunProcess, OpenAI],
) -> None:
    run, client = served
    assert run.banner.fields["model"] == MODEL
    assert run.banner.fields["Kafka bootstrap"].startswith("127.0.0.1:")
    assert run.banner.fields["admin API"].startswith("http://127.0.0.1:")
    # Asked once, no retry, the moment its last line was read.
    at = run.at_banner
    assert at.models is not None and at.models.status == 200, at.models
    assert MODEL in at.models.body
    assert at.service_ready.status == 200, at.service_ready
    assert at.executor_states() == ["ready"], at.executors
    # A request served since (by this test or the others), and still one banner.
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    assert run.banners_printed() == 1, run.stdout


def test_a_healthy_start_logs_no_warning(served: tuple[RunProcess, OpenAI]) -> None:
    run, _ = served
    logged = run.log.read_text().splitlines()
    assert logged, "kvgate run logs its start-up"
    assert [line for line in logged if " WARNING " in line or " ERROR " in line] == []


def test_greedy_completion_equals_transformers(
    client: OpenAI, hf_model: Any, hf_tokenizer: Any
) -> None:
    prompt = "The capital of France is"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.model == MODEL
    assert answer.choices[0].text.strip(), "real text, decoded"
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
