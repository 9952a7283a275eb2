"""What the service makes of a request's tools: the grammar that forces a call, and the calls
found in an output.

``tool_choice``::

    none        the tools are rendered; the output is text
    auto        the output is parsed in the model's format (``tool_parsers``): calls if it wrote
                any, else text
    required    the output is forced by the mask to a JSON array of one or more calls (one when
                ``parallel_tool_calls`` is false):  [{"name": "f", "parameters": {...}}, ...]
                each item's parameters valid under its function's schema
    {"name"}    the output is forced to that function's arguments: a JSON object valid under
                its schema

as vLLM forces them: the forced shapes are plain JSON rather than the model's own format, so
any model — a tiny random one too — produces valid calls.
"""

from __future__ import annotations

import json
from typing import Final

from pydantic import JsonValue

from kvgate.admission_service.tool_parsers import (
    ParsedCall,
    ParsedOutput,
    ToolCallFormat,
    call_of,
    parse_tool_calls,
)
from kvgate.protocol.records import InferenceRequest
from kvgate.protocol.structured import GrammarKind, GrammarSpec, canonical_json
from kvgate.protocol.tools import (
    FunctionCall,
    NamedTool,
    ToolCall,
    ToolChoiceMode,
    ToolDefinition,
    tool_call_id,
)

PARAMETERS_KEY: Final = "parameters"


def _call_schema(tool: ToolDefinition) -> dict[str, JsonValue]:
    function = tool.function
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            PARAMETERS_KEY: function.parameters_schema(),
        },
        "required": ["name", PARAMETERS_KEY],
        "additionalProperties": False,
    }


def forced_call_schema(request: InferenceRequest) -> dict[str, JsonValue] | None:
    """The JSON schema a forced tool choice holds the output to; None when none is forced."""
    if not request.forces_tool_call or request.tools is None:
        return None
    choice = request.effective_tool_choice
    if isinstance(choice, NamedTool):
        tool = next(t for t in request.tools if t.function.name == choice.name)
        return tool.function.parameters_schema()
    items: list[JsonValue] = [_call_schema(tool) for tool in request.tools]
    schema: dict[str, JsonValue] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def request_grammar(request: InferenceRequest) -> GrammarSpec | None:
    """The one grammar the request's output is masked by: its structured output, or the shape
    of a forced tool call; None when the output is free."""
    forced = forced_call_schema(request)
    if forced is not None:
        return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=canonical_json(forced))
    if request.structured_output is not None:
        return request.structured_output.grammar_spec()
    return None


def _forced_calls(request: InferenceRequest, text: str) -> ParsedOutput:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens: no call, the text as it is
        return ParsedOutput(text or None, ())
    choice = request.effective_tool_choice
    if isinstance(choice, NamedTool):
        if not isinstance(raw, dict):
            return ParsedOutput(text or None, ())
        # The arguments as generated (streamed as they came; the mask made them valid).
        return ParsedOutput(None, (ParsedCall(choice.name, text.strip()),))
    names = frozenset(t.function.name for t in request.tools or [])
    items = raw if isinstance(raw, list) else []
    calls = [call_of(item, names, PARAMETERS_KEY) for item in items]
    if not calls or any(c is None for c in calls):
        return ParsedOutput(text or None, ())
    return ParsedOutput(None, tuple(c for c in calls if c is not None))


def find_tool_calls(
    request: InferenceRequest, text: str, raw_text: str, fmt: ToolCallFormat, choice_index: int
) -> tuple[str | None, list[ToolCall]] | None:
    """The text and the calls of one choice's output; None when the request has no tools to
    call (``text`` is the output decoded as the result shows it, ``raw_text`` with its special
    tokens, which the model-format parsers need)."""
    if request.tools is None or request.effective_tool_choice is ToolChoiceMode.NONE:
        return None
    if request.forces_tool_call:
        parsed = _forced_calls(request, text)
    else:
        names = frozenset(t.function.name for t in request.tools)
        parsed = parse_tool_calls(raw_text, fmt, names)
        if not parsed.calls:
            return text, []
    calls = [
        ToolCall(
            id=tool_call_id(request.request_id, choice_index, i),
            function=FunctionCall(name=c.name, arguments=c.arguments),
        )
        for i, c in enumerate(parsed.calls)
    ]
    return parsed.content, calls
