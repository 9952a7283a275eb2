"""LangChain, litellm, instructor and the OpenAI Agents SDK, each as its users call it, against
the real stack (tiny random model): plain calls, structured outputs, forced tool calls and an
agent's tool loop."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import Served

pytestmark = pytest.mark.timeout(600)


class Person(BaseModel):
    """Someone, described."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


class Add(BaseModel):
    """Add two small numbers."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


def test_langchain_chat_structured_output_and_bound_tools(served: Served) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=served.base_url, api_key="unused", model=served.model, max_retries=0,  # type: ignore[arg-type]
        temperature=0, max_tokens=80,  # type: ignore[call-arg]
    )  # fmt: skip
    assert isinstance(chat.invoke("Hello").content, str)
    assert "".join(str(c.content) for c in chat.stream("Hello"))
    person = chat.with_structured_output(Person, method="json_schema").invoke("Who?")
    assert isinstance(person, Person)
    tooled = chat.bind_tools([Add], tool_choice="any").invoke("2 + 3?")
    assert tooled.tool_calls and tooled.tool_calls[0]["name"] == "Add"  # type: ignore[attr-defined]
    Add.model_validate(tooled.tool_calls[0]["args"])  # type: ignore[attr-defined]


def test_litellm_completion(served: Served) -> None:
    import litellm

    answer = litellm.completion(
        model=f"openai/{served.model}", api_base=served.base_url, api_key="unused",
        messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0,
        num_retries=0,
    )  # fmt: skip
    assert answer.choices[0].message.content is not None  # type: ignore[union-attr]
    structured = litellm.completion(
        model=f"openai/{served.model}", api_base=served.base_url, api_key="unused",
        messages=[{"role": "user", "content": "Who?"}], max_tokens=80, temperature=0,
        response_format=Person, num_retries=0,
    )  # fmt: skip
    Person.model_validate_json(structured.choices[0].message.content)  # type: ignore[union-attr,arg-type]


# Mode.JSON asks for any JSON object (response_format json_object) and puts the schema in the
# prompt: a random model writes keys of its own forever, so that mode is tried on SmolLM2
# (tests/real_model/test_clients_smollm2.py); these two force the schema itself.
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_valid_model(served: Served, mode: str) -> None:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=served.base_url, api_key="unused", max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    person = client.chat.completions.create(
        model=served.model, response_model=Person, max_retries=0, max_tokens=80,
        temperature=0, messages=[{"role": "user", "content": "Who?"}],
    )  # fmt: skip
    assert isinstance(person, Person)


class Sum(BaseModel):
    value: int = Field(ge=0, le=99)


def test_an_agent_calls_its_tool_and_answers(served: Served) -> None:
    """Turn one is forced to call the tool; after it the SDK resets tool_choice and the agent's
    output type (a JSON schema) shapes the answer, so even a random model ends its turn."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two numbers."""
        calls.append((a, b))
        return str(a + b)

    async def run(model: object) -> object:
        agent = Agent(
            name="adder", instructions="Add numbers with the tool.", tools=[add],
            model=model, output_type=Sum,  # type: ignore[arg-type]
            model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
        )  # fmt: skip
        result = await Runner.run(agent, "What is 2 + 3?", max_turns=4)
        return result.final_output

    for kind in (OpenAIResponsesModel, OpenAIChatCompletionsModel):
        # A client per event loop (asyncio.run closes its loop, and the client's connections).
        client = AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        model = kind(model=served.model, openai_client=client)
        before = len(calls)
        answer = asyncio.run(run(model))
        assert len(calls) == before + 1, type(model).__name__
        assert isinstance(answer, Sum)
    assert all(isinstance(a, int) and isinstance(b, int) for a, b in calls)
