"""The official ``openai`` client against the real stack (tiny random model): structured outputs
(a conforming object every time, at temperature 0 and 1), vLLM's guided fields, tool calls
(forced and streamed), ``n``, streamed logprobs, every sampling field, prompt scoring, the
Responses API, ``/tokenize`` and ``/detokenize``, neutral defaults, and 400s naming the field."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.clients.conftest import Served

pytestmark = pytest.mark.timeout(600)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "Tell me about someone."}]


@pytest.fixture(scope="module")
def client(served: Served) -> OpenAI:
    return OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_conform_every_time(
    client: OpenAI, served: Served, temperature: float
) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model=served.model, messages=USER, max_tokens=120, temperature=temperature,
            seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_and_the_guided_fields(client: OpenAI, served: Served) -> None:
    answer = client.chat.completions.create(
        model=served.model, messages=USER, max_tokens=60, temperature=1.0, seed=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    content = answer.choices[0].message.content or ""
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert content.startswith("{")
    for extra, check in [
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"grammar": 'start: "ab" /[xy]{2}/'}},
         lambda t: re.fullmatch("ab[xy]{2}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "c" [0-9] [0-9]'}},
         lambda t: re.fullmatch("c[0-9]{2}", t)),
    ]:  # fmt: skip
        answer = client.completions.create(
            model=served.model, prompt="Answer:", max_tokens=20, temperature=1.0, extra_body=extra
        )
        text = answer.choices[0].text
        assert check(text), (extra, text)


def test_an_invalid_schema_is_a_400_naming_the_field(client: OpenAI, served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=served.model, messages=USER, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    error: Any = caught.value.body
    assert error["param"] == "response_format" and "type" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=served.model, prompt="x", max_tokens=5, extra_body={"guided_regex": "[a-"}
        )
    assert "regex" in str(caught.value)


def test_forced_tool_calls_carry_valid_arguments(client: OpenAI, served: Served) -> None:
    named = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "2 + 3?"}], max_tokens=60,
        tools=[ADD, WEATHER], tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
    )  # fmt: skip
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "add" and call.id.startswith("call_")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])  # type: ignore[union-attr,index]
    required = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "weather?"}], max_tokens=80,
        tools=[ADD, WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0.0,
    )  # fmt: skip
    calls = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    tool = {"add": ADD, "weather": WEATHER}[calls[0].function.name]  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])  # type: ignore[union-attr,index]


def test_a_conversation_that_used_tools_continues(client: OpenAI, served: Served) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "2 + 3?", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=served.model, messages=messages, tools=[ADD], max_tokens=8, temperature=0.0,
        tool_choice="none",
    )  # fmt: skip
    assert answer.choices[0].message.content is not None
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_assemble_to_the_answer(client: OpenAI, served: Served) -> None:
    asked: dict[str, Any] = dict(
        model=served.model, messages=[{"role": "user", "content": "2 + 3?"}], max_tokens=60,
        tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0, seed=11,
    )  # fmt: skip
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls or []
    arguments, ids, finish = "", set(), None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                arguments += delta.function.arguments or ""  # type: ignore[union-attr]
                if delta.id:
                    ids.add(delta.id)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert arguments == whole[0].function.arguments  # type: ignore[union-attr]
    assert len(ids) == 1 and next(iter(ids)).startswith("call_")  # one call, opened once


def test_n_choices_and_streamed_logprobs(client: OpenAI, served: Served) -> None:
    answer = client.chat.completions.create(
        model=served.model, messages=USER, max_tokens=12, n=3, temperature=1.0, seed=4,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2]
    counted = [len(c.logprobs.content or []) for c in answer.choices]  # type: ignore[union-attr]
    assert answer.usage is not None and answer.usage.completion_tokens == sum(counted)
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    entries: dict[int, int] = {0: 0, 1: 0, 2: 0}
    stream = client.chat.completions.create(
        model=served.model, messages=USER, max_tokens=12, n=3, temperature=1.0, seed=4,
        logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                entries[choice.index] += len(choice.logprobs.content or [])
                assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content or [])
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert entries == {c.index: len(c.logprobs.content or []) for c in answer.choices}  # type: ignore[union-attr]


def test_every_sampling_field_is_accepted_and_applied(client: OpenAI, served: Served) -> None:
    common: dict[str, Any] = dict(model=served.model, prompt="abc", max_tokens=8, temperature=0)
    plain = client.completions.create(**common).choices[0]
    only_x = {str(t): -100 for t in range(256)} | {"120": 100}  # "x" is 120
    banned = client.completions.create(**common, logit_bias=only_x).choices[0]
    assert banned.text == "x" * 8 and plain.text != banned.text
    shaped = client.completions.create(
        **common, presence_penalty=1.5, frequency_penalty=1.0, seed=1,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 8, "top_k": 20,
                    "stop_token_ids": [0], "ignore_eos": False},
    ).choices[0]  # fmt: skip
    assert shaped.finish_reason == "length"


def test_echo_scores_the_prompt(client: OpenAI, served: Served) -> None:
    scored = client.completions.create(
        model=served.model, prompt="hello there", max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    assert scored.text == "hello there"
    logprobs: Any = scored.logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len("hello there")
    assert all(v < 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == "hello there"


def test_the_responses_api(client: OpenAI, served: Served) -> None:
    # Greedy where the answer must fit its token budget (a random model may sample JSON's free
    # whitespace or escapes at length; greedy decoding gives one answer, the same every run).
    response = client.responses.create(
        model=served.model, input="Hello", instructions="Be brief.", max_output_tokens=6,
        store=False,
    )  # fmt: skip
    assert response.status in ("completed", "incomplete") and response.output_text is not None
    structured = client.responses.create(
        model=served.model, input="Someone?", max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
    )  # fmt: skip
    jsonschema.validate(json.loads(structured.output_text), PERSON)
    tools = [{"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}]  # type: ignore[index]
    called = client.responses.create(
        model=served.model, input="2 + 3?", tools=tools, tool_choice="required",  # type: ignore[arg-type]
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    items = [item for item in called.output if item.type == "function_call"]
    assert items and items[0].name == "add"  # type: ignore[union-attr]
    follow_up = client.responses.create(
        model=served.model, max_output_tokens=5,
        input=[{"role": "user", "content": "2 + 3?"},
               {"type": "function_call", "call_id": items[0].call_id, "name": "add",  # type: ignore[union-attr]
                "arguments": items[0].arguments},  # type: ignore[union-attr]
               {"type": "function_call_output", "call_id": items[0].call_id, "output": "5"}],  # type: ignore[union-attr]
    )  # fmt: skip
    assert follow_up.status in ("completed", "incomplete")
    streamed, events = "", []
    for event in client.responses.create(
        model=served.model, input="Hello", max_output_tokens=6, stream=True
    ):
        events.append(event)
        if event.type == "response.output_text.delta":
            streamed += event.delta
    kinds = [event.type for event in events]
    # Cut by max_output_tokens: OpenAI ends such a stream with response.incomplete.
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert streamed == events[-1].response.output_text  # type: ignore[union-attr]


def test_tokenize_and_detokenize(served: Served) -> None:
    def post(path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            served.root_url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    tokens = post("/tokenize", {"model": served.model, "prompt": "héllo"})
    assert tokens["count"] == len("héllo".encode()) and tokens["tokens"][0] == ord("h")
    assert post("/detokenize", {"model": served.model, "tokens": tokens["tokens"]}) == {
        "prompt": "héllo"
    }
    chat = post("/tokenize", {"model": served.model, "messages": USER})
    text = post("/detokenize", {"tokens": chat["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>assistant\n")
