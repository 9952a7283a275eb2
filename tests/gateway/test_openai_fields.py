"""The OpenAI fields clients send, mapped to the Kafka record or refused by name; the Responses
API's input as chat messages; the stream assembler's chunks for choices, logprobs and tool
calls (pure: no Kafka here)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.gateway.openai_api import (
    ApiError,
    ChatBody,
    CompletionBody,
    Mapped,
    parse_body,
    to_request,
)
from kvgate.gateway.responses import chat_body, completion_body
from kvgate.gateway.responses_api import ResponsesBody, output_items, to_responses_request
from kvgate.gateway.streaming import StreamAssembler
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import (
    Choice,
    InferenceResult,
    OutputLogprobs,
    PromptLogprob,
    ReplyTo,
    ResultStatus,
    SourceRef,
    Timings,
    TokenChunk,
    Usage,
)
from kvgate.protocol.structured import StructuredOutput
from kvgate.protocol.tools import FunctionCall, NamedTool, ToolCall, ToolChoiceMode, tool_call_id

REPLY = ReplyTo(topic="kvgate.replies.test", partition=0)
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _map(body: dict[str, Any], model: type[CompletionBody | ChatBody] = ChatBody) -> Mapped:
    parsed = parse_body(model, {"model": "m", **body})
    return to_request(parsed, request_id="r1", priority=0, default_max_tokens=50, reply=REPLY)


# What the official clients send by default, and neutral values every library may send.
NEUTRAL_CHAT = {
    "response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": False,
    "store": False, "service_tier": "auto", "metadata": {"k": "v"}, "user": "u", "seed": 3,
    "stream_options": None, "n": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "logit_bias": {}, "modalities": ["text"], "top_p": 1, "temperature": 0.7,
    "safety_identifier": "s", "prompt_cache_key": "p", "function_call": None,
    "skip_special_tokens": True, "include_stop_str_in_output": False,
}  # fmt: skip


def test_every_neutral_value_clients_send_is_accepted() -> None:
    mapped = _map({"messages": USER, **NEUTRAL_CHAT})
    request = mapped.request
    assert request.structured_output is None and request.tools is None and request.n == 1
    completion = _map(
        {"prompt": "a", "best_of": 1, "echo": False, "suffix": None, "logprobs": None},
        CompletionBody,
    )
    assert completion.request.prompt == "a"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"echo": True}, "echo"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_a_value_that_would_change_behaviour_is_refused_by_name(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _map({"messages": USER} | body)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_sampling_tools_and_structured_fields_map_to_the_record() -> None:
    mapped = _map(
        {"messages": USER, "n": 3, "presence_penalty": 0.5, "frequency_penalty": 0.25,
         "repetition_penalty": 1.1, "logit_bias": {"12": -100}, "min_p": 0.1, "min_tokens": 2,
         "stop_token_ids": [7], "logprobs": True, "top_logprobs": 2, "stream": True,
         "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}},
         "parallel_tool_calls": False}
    )  # fmt: skip
    r = mapped.request
    s = r.sampling
    assert (r.n, r.logprobs, s.presence_penalty, s.frequency_penalty) == (3, 2, 0.5, 0.25)
    assert (s.repetition_penalty, s.logit_bias, s.min_p, s.min_tokens) == (
        1.1,
        {12: -100.0},
        0.1,
        2,
    )
    assert s.stop_token_ids == [7] and r.reply is not None and r.reply.tokens
    assert r.tool_choice == NamedTool(name="add") and not r.parallel_tool_calls
    assert mapped.forced_tool and not mapped.tools_auto
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert _map({"messages": USER, "response_format": rf}).request.structured_output == (
        StructuredOutput(json_schema=schema)
    )
    for field, value, expected in [
        ("guided_json", schema, StructuredOutput(json_schema=schema)),
        ("guided_json", json.dumps(schema), StructuredOutput(json_schema=schema)),
        ("guided_regex", "[a-z]+", StructuredOutput(regex="[a-z]+")),
        ("guided_choice", ["y", "n"], StructuredOutput(choice=["y", "n"])),
        ("guided_grammar", "start: /x/", StructuredOutput(grammar="start: /x/")),
        ("structured_outputs", {"choice": ["a"]}, StructuredOutput(choice=["a"])),
        ("response_format", {"type": "json_object"}, StructuredOutput(json_object=True)),
    ]:
        mapped = _map({"messages": USER, field: value})
        assert mapped.request.structured_output == expected, field
    auto = _map({"messages": USER, "tools": [TOOL]})
    assert auto.tools_auto and auto.request.effective_tool_choice is ToolChoiceMode.AUTO


def test_conversations_that_used_tools_are_accepted() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "add 1 and 2", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]  # fmt: skip
    r = _map({"messages": messages, "tools": [TOOL]}).request
    assert r.messages is not None
    assert [m.role for m in r.messages] == ["system", "user", "assistant", "tool"]
    assert r.messages[2].tool_calls is not None and r.messages[2].content is None
    assert r.messages[3].tool_call_id == "call_1" and r.messages[1].name == "ann"


def test_echo_and_max_tokens_0_score_the_prompt() -> None:
    m = _map({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0}, CompletionBody)
    assert m.echo and m.request.prompt_logprobs == 1 and m.request.max_tokens == 0
    m = _map({"prompt": [5, 6], "max_tokens": 0}, CompletionBody)
    assert m.request.prompt_logprobs == 0
    prompt = [
        PromptLogprob(token_id=5, logprob=None, token="a"),
        PromptLogprob(token_id=6, logprob=-1.5, token="bc"),
    ]
    result = _result(prompt_logprobs=prompt, text="", logprobs=[], tokens=[])
    m = _map({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0}, CompletionBody)
    body = completion_body(result, "m", 0, m, None)
    choice = body["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["tokens"] == ["a", "bc"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5]
    assert choice["logprobs"]["text_offset"] == [0, 1]


def _result(**fields: Any) -> InferenceResult:
    base: dict[str, Any] = {
        "request_id": "r1", "status": ResultStatus.COMPLETED, "finish_reason": FinishReason.STOP,
        "text": "hello", "output_token_ids": [1, 2],
        "usage": Usage(prompt_tokens=3, completion_tokens=2),
        "timings": Timings(end_to_end_s=0.1), "source": SourceRef(topic="t", partition=0, offset=0),
    }  # fmt: skip
    tokens = fields.pop("tokens", None)
    if tokens is not None:
        base["output_token_ids"] = tokens
    return InferenceResult(**(base | fields))


def test_chat_bodies_carry_choices_tool_calls_and_refusal_null() -> None:
    call = ToolCall(id="call_x", function=FunctionCall(name="add", arguments='{"a": 1}'))
    result = _result(
        finish_reason=FinishReason.TOOL_CALLS, text=None, tool_calls=[call],
        choices=[
            Choice(index=0, finish_reason=FinishReason.TOOL_CALLS, tool_calls=[call]),
            Choice(index=1, finish_reason=FinishReason.STOP, text="no"),
        ],
    )  # fmt: skip
    body = chat_body(result, "m", 0, _map({"messages": USER, "n": 2}), None)
    first, second = body["choices"]
    assert first["message"] == {
        "role": "assistant", "content": None, "refusal": None,
        "tool_calls": [{"id": "call_x", "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1}'}}],
    }  # fmt: skip
    assert first["finish_reason"] == "tool_calls"
    assert second["message"]["content"] == "no" and second["index"] == 1


class _Chars:
    """One character per token id (ord), special tokens none."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def _chunks(text: str, choice: int = 0, logprob: float | None = None) -> list[TokenChunk]:
    return [
        TokenChunk(request_id="r1", index=i, token_id=ord(c), exit_depth=1, choice=choice,
                   logprob=logprob, top_logprobs=[] if logprob is not None else None)
        for i, c in enumerate(text)
    ]  # fmt: skip


def _stream(mapped: Mapped, tokens: list[TokenChunk], result: InferenceResult) -> list[Any]:
    assembler = StreamAssembler(mapped, _Chars(), "m", chat=True)  # type: ignore[arg-type]
    events = assembler.opening()
    for token in tokens:
        events += assembler.token(token)
    return events + assembler.finish(result)


def _deltas(events: list[Any], index: int, key: str) -> list[Any]:
    return [
        c["delta"][key] for e in events for c in e["choices"]
        if c["index"] == index and key in c.get("delta", {})
    ]  # fmt: skip


def test_a_stream_of_two_choices_with_logprobs() -> None:
    mapped = _map({"messages": USER, "n": 2, "stream": True, "logprobs": True})
    result = _result(
        text="ab",
        choices=[Choice(index=0, finish_reason=FinishReason.STOP, text="ab"),
                 Choice(index=1, finish_reason=FinishReason.LENGTH, text="xyz")],
    )  # fmt: skip
    events = _stream(mapped, _chunks("ab", 0, -0.5) + _chunks("xyz", 1, -0.25), result)
    assert "".join(_deltas(events, 0, "content")) == "ab"
    assert "".join(_deltas(events, 1, "content")) == "xyz"
    entries = [
        entry for e in events for c in e["choices"] if c["index"] == 1 and c.get("logprobs")
        for entry in c["logprobs"]["content"]
    ]  # fmt: skip
    assert [e["token"] for e in entries] == ["x", "y", "z"]
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"]
                if c["finish_reason"]}  # fmt: skip
    assert finishes == {0: "stop", 1: "length"}


def test_a_result_that_overtakes_its_token_chunks_brings_the_rest_of_the_logprobs() -> None:
    """Token chunks and results come from two topics: when the result arrives after only some
    of a choice's chunks, the last event carries the rest of the text and of the logprobs, and
    every token has its one entry, in order."""
    mapped = _map({"messages": USER, "stream": True, "logprobs": True, "top_logprobs": 1})
    entries = [OutputLogprobs(token_id=ord(c), logprob=-0.5, token=c, top=[]) for c in "hello"]
    result = _result(
        text="hello",
        choices=[Choice(index=0, finish_reason=FinishReason.LENGTH, text="hello",
                        logprobs=entries)],
    )  # fmt: skip
    events = _stream(mapped, _chunks("he", 0, -0.5), result)
    assert "".join(_deltas(events, 0, "content")) == "hello"
    sent = [
        entry["token"] for e in events for c in e["choices"] if c.get("logprobs")
        for entry in c["logprobs"]["content"]
    ]  # fmt: skip
    assert sent == list("hello")


def test_a_named_call_streams_its_arguments_and_an_auto_call_is_held_back() -> None:
    named = _map({"messages": USER, "stream": True, "tools": [TOOL],
                  "tool_choice": {"type": "function", "function": {"name": "add"}}})  # fmt: skip
    arguments = '{"a": 1}'
    call = ToolCall(
        id=tool_call_id("r1", 0, 0), function=FunctionCall(name="add", arguments=arguments)
    )
    result = _result(text=None, tool_calls=[call], finish_reason=FinishReason.TOOL_CALLS)
    events = _stream(named, _chunks(arguments), result)
    calls = [c for batch in _deltas(events, 0, "tool_calls") for c in batch]
    assert calls[0]["id"] == call.id and calls[0]["function"]["name"] == "add"
    assert "".join(c["function"]["arguments"] for c in calls) == arguments
    assert not [text for text in _deltas(events, 0, "content") if text]
    auto = _map({"messages": USER, "stream": True, "tools": [TOOL]})
    text = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    result = _result(text="Sure", tool_calls=[call], finish_reason=FinishReason.TOOL_CALLS)
    events = _stream(auto, _chunks(text), result)
    content = "".join(_deltas(events, 0, "content"))
    assert content.strip() == "Sure" and "<tool" not in content
    assert [c["function"]["name"] for b in _deltas(events, 0, "tool_calls") for c in b] == ["add"]
    plain = _result(text="Hello there")
    events = _stream(auto, _chunks("Hello there"), plain)
    assert "".join(_deltas(events, 0, "content")) == "Hello there"


def test_the_responses_api_input_becomes_chat_messages() -> None:
    body = parse_body(ResponsesBody, {
        "model": "m", "instructions": "be brief", "store": False,
        "input": [
            {"role": "user", "content": "add"},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    })  # fmt: skip
    mapped = to_responses_request(
        body, request_id="r1", priority=0, default_max_tokens=50, reply=REPLY
    )
    messages = mapped.request.messages
    assert messages is not None
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool"]
    assert mapped.request.structured_output == StructuredOutput(json_schema={"type": "object"})
    call = ToolCall(id="call_1", function=FunctionCall(name="add", arguments="{}"))
    items = output_items(_result(text=None, tool_calls=[call]))
    assert [i["type"] for i in items] == ["function_call"] and items[0]["call_id"] == "call_1"
    with pytest.raises(ApiError) as caught:
        parse_body(ResponsesBody, {"model": "m", "input": "x", "previous_response_id": "r"})
    assert caught.value.param == "previous_response_id"


def test_logprob_entries_of_a_result_shape_as_openai_does() -> None:
    entry = OutputLogprobs(token_id=1, logprob=-0.1, token="a")
    body = chat_body(_result(logprobs=[entry]), "m", 0, _map({"messages": USER}), None)
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "a"
