"""The client libraries against ``kvgate run`` serving SmolLM2 (the slow tier: a real model on a
CPU): instructor's JSON mode (the schema only in the prompt, any JSON object forced), LangChain's
structured output and tools, the Agents SDK, and vLLM-style scoring through the gateway."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.gateway.conftest import _env, free_port
from tests.gateway.kvgate_run import kvgate_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
MODEL = "SmolLM2-135M-Instruct"


class Capital(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)
    confidence: Literal["high", "low"]


@pytest.fixture(scope="module")
def base_url(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    out = tmp_path_factory.mktemp("smollm2-clients")
    args = ("--gateway-port", str(port), "--port", str(free_port()))
    with kvgate_run(out, *args, env=_env()) as run:
        assert run.banner.openai_url is not None
        yield run.banner.openai_url


def test_instructor_json_mode_on_a_real_model(base_url: str) -> None:
    """Mode.JSON forces any JSON object and leaves the schema to the prompt: the answer is an
    object every time; whether it has the model's fields is the model's doing (a 135M model
    follows the schema in the prompt only sometimes)."""
    import instructor
    from instructor.core.exceptions import InstructorRetryException

    client = instructor.from_openai(
        OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=instructor.Mode.JSON
    )
    try:
        answer, completion = client.chat.completions.create_with_completion(
            model=MODEL, response_model=Capital, max_retries=0, max_tokens=120, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )  # fmt: skip
    except InstructorRetryException as exc:  # an object, without the model's fields
        completion = exc.last_completion
    else:
        assert isinstance(answer, Capital)
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_langchain_structured_output_and_auto_tools(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=base_url, api_key="unused", model=MODEL, max_retries=0, temperature=0,  # type: ignore[arg-type]
        max_tokens=120,  # type: ignore[call-arg]
    )  # fmt: skip
    capital = chat.with_structured_output(Capital, method="json_schema").invoke(
        "What is the capital of France?"
    )
    assert isinstance(capital, Capital) and "Paris" in capital.city  # type: ignore[union-attr]

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=30)

    message = chat.bind_tools([Weather]).invoke("What is the weather in Paris?")
    # auto: a tool call in the Hermes format, or text; either way a well-formed message.
    for call in message.tool_calls:  # type: ignore[attr-defined]
        Weather.model_validate(call["args"])


def test_the_prompt_is_scored_through_the_gateway(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    likely = client.completions.create(
        model=MODEL, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    unlikely = client.completions.create(
        model=MODEL, prompt="The capital of France is Tokyo", max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    assert likely.logprobs is not None and unlikely.logprobs is not None
    assert likely.logprobs.token_logprobs[-1] > unlikely.logprobs.token_logprobs[-1]  # type: ignore[index,operator]
    json.dumps(likely.logprobs.token_logprobs)
