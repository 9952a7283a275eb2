"""Tools in the service: the three model-format parsers, the forced-call grammar and its
parsing, chat templates that render tools themselves or get kvgate's Hermes prompt, and the
rejections of a structured output or a tool choice the grammar engine or the schema refuses."""

from __future__ import annotations

import json

import pytest

from kvgate.admission_service.chat import TOOL_PROMPT, ChatTemplate
from kvgate.admission_service.tool_calls import find_tool_calls, forced_call_schema
from kvgate.admission_service.tool_parsers import (
    ParsedCall,
    ToolCallFormat,
    detect_format,
    parse_tool_calls,
)
from kvgate.admission_service.validation import Accepted, Rejection, validate_request
from kvgate.grammar import compiled_grammar
from kvgate.protocol.records import ChatMessage, InferenceRequest, RejectCode
from kvgate.protocol.structured import GrammarSpec

from .helpers import record, request_body

NAMES = frozenset({"get_weather", "add"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (ToolCallFormat.HERMES, "Sure.\n<tool_call>\n"
         '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>'
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>', "Sure.",
         [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("get_weather", '{"city": "Oslo"}')]),
        (ToolCallFormat.HERMES, "no calls here", "no calls here", []),
        (ToolCallFormat.HERMES, '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),  # unknown: text
        (ToolCallFormat.LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": 1, '
         '"b": 2}}; {"name": "get_weather", "parameters": {"city": "Rome"}}', None,
         [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("get_weather", '{"city": "Rome"}')]),
        (ToolCallFormat.LLAMA3_JSON, "{not json", "{not json", []),
        (ToolCallFormat.MISTRAL, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3, "b": 4}}]',
         None, [ParsedCall("add", '{"a": 3, "b": 4}')]),
        (ToolCallFormat.MISTRAL, 'Hm.[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}', "Hm.",
         [ParsedCall("add", '{"a": 5, "b": 6}')]),
    ],
)  # fmt: skip
def test_each_format_parses_its_calls_and_leaves_the_rest_as_text(
    fmt: ToolCallFormat, text: str, content: str | None, calls: list[ParsedCall]
) -> None:
    parsed = parse_tool_calls(text, fmt, NAMES)
    assert parsed.content == content
    assert list(parsed.calls) == calls


def test_the_format_comes_from_the_template() -> None:
    assert detect_format("{{ '[TOOL_CALLS]' }}") is ToolCallFormat.MISTRAL
    assert detect_format("<|python_tag|>{{ x }}") is ToolCallFormat.LLAMA3_JSON
    assert detect_format("<tool_call>{{ x }}") is ToolCallFormat.HERMES
    assert detect_format(None) is ToolCallFormat.HERMES


def _request(**fields: object) -> InferenceRequest:
    base: dict[str, object] = {"request_id": "t", "messages": [{"role": "user", "content": "hi"}]}
    return InferenceRequest.model_validate_json(json.dumps(base | fields))


def test_forced_calls_are_json_under_the_functions_schemas() -> None:
    named = _request(tools=[WEATHER, ADD], tool_choice={"name": "add"})
    assert forced_call_schema(named) == ADD["function"]["parameters"]  # type: ignore[index]
    text, calls = find_tool_calls(named, '{"a": 1, "b": 2}', "", ToolCallFormat.HERMES, 0)  # type: ignore[misc]
    assert text is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("add", '{"a": 1, "b": 2}')
    ]
    required = _request(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    schema = forced_call_schema(required)
    assert schema is not None and schema["minItems"] == 1 and schema["maxItems"] == 1
    compiled_grammar(GrammarSpec(kind="json_schema", source=json.dumps(schema)))
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    text, calls = find_tool_calls(required, out, out, ToolCallFormat.HERMES, 0)  # type: ignore[misc]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # Cut short by max_tokens: no call, the text as it is.
    assert find_tool_calls(required, "[{", "[{", ToolCallFormat.HERMES, 0) == ("[{", [])
    assert find_tool_calls(_request(), "x", "x", ToolCallFormat.HERMES, 0) is None


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    '{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}'
    '", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "content": "12 C", "tool_call_id": "call_1", "name": "get_weather"},
]  # fmt: skip


def test_a_template_with_tools_renders_them_and_the_calls_itself() -> None:
    template = ChatTemplate(QWEN_LIKE)
    assert template.renders_tools and template.tool_call_format is ToolCallFormat.HERMES
    messages = [ChatMessage.model_validate(m) for m in CONVERSATION]
    tools = _request(tools=[WEATHER]).tools
    text = template.render(messages, tools)
    assert '"name": "get_weather"' in text and "<tools>" in text
    # Arguments reach the template as an object (rendered back to JSON by tojson).
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\n12 C" in text


def test_a_template_without_tools_gets_the_hermes_prompt() -> None:
    template = ChatTemplate(CHATML)
    assert not template.renders_tools
    messages = [ChatMessage.model_validate(m) for m in CONVERSATION]
    text = template.render(messages, _request(tools=[WEATHER]).tools)
    assert text.startswith("<|im_start|>system\n" + TOOL_PROMPT.split("<tools>")[0])
    assert '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "None" not in text


@pytest.mark.parametrize(
    ("fields", "code", "needle"),
    [
        ({"structured_output": {"regex": "[a-"}}, RejectCode.STRUCTURED_OUTPUT, "unclosed"),
        ({"structured_output": {"json_schema": {"type": 5}}}, RejectCode.STRUCTURED_OUTPUT,
         "type must be"),
        ({"structured_output": {"grammar": "start: nothing_here"}},
         RejectCode.STRUCTURED_OUTPUT, "nothing_here"),
        ({"structured_output": {"regex": "a", "choice": ["b"]}}, RejectCode.SCHEMA, "exactly one"),
        ({"tools": [WEATHER]}, RejectCode.SCHEMA, "tools need messages"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": None, "tools": [WEATHER],
          "tool_choice": {"name": "nope"}}, RejectCode.SCHEMA, "not among the tools"),
        ({"sampling": {"logit_bias": {"x": 1}}}, RejectCode.SCHEMA, "logit_bias"),
        ({"sampling": {"min_tokens": 9}, "max_tokens": 4}, RejectCode.SCHEMA, "min_tokens"),
        ({"max_tokens": 0}, RejectCode.SCHEMA, "only scores the prompt"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_it(
    fields: dict[str, object], code: RejectCode, needle: str
) -> None:
    body = request_body("bad", prompt=[1, 2, 3]) | fields
    verdict = validate_request(record(body, 0), _limits(), None)
    assert isinstance(verdict, Rejection), verdict
    assert verdict.code is code and needle in verdict.reason, verdict.reason


def test_a_valid_structured_output_is_accepted() -> None:
    body = request_body("ok", prompt=[1, 2, 3], structured_output={"choice": ["yes", "no"]})
    assert isinstance(validate_request(record(body, 0), _limits(), None), Accepted)


def _limits():  # type: ignore[no-untyped-def]
    from kvgate.admission_service.settings import LimitsSettings

    return LimitsSettings()


def test_the_parser_is_the_templates_unless_the_service_names_one(tmp_path: object) -> None:
    from pathlib import Path

    from kvgate.admission_service.settings import LimitsSettings
    from kvgate.admission_service.tokenizer import load_tokenizer
    from kvgate.executor.tokenizer import build_byte_tokenizer

    folder = Path(str(tmp_path))
    build_byte_tokenizer().save(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_LIKE}))
    assert load_tokenizer(folder / "tokenizer.json").tool_call_format() is ToolCallFormat.HERMES
    named = LimitsSettings(tool_call_parser="mistral").tool_call_parser
    chosen = load_tokenizer(folder / "tokenizer.json", named)
    assert chosen.tool_call_format() is ToolCallFormat.MISTRAL
