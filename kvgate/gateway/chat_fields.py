"""The structured fields of OpenAI chat bodies: messages (text parts, tool calls, tool results),
tools, tool choice and response format, each with its mapping to the Kafka record's field of the
same meaning (``kvgate.protocol.records`` / ``tools`` / ``structured``).

Shapes follow OpenAI's API reference; what kvgate cannot serve (images, audio, files in a
message; custom or built-in tools) is a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from kvgate.protocol.records import ChatMessage
from kvgate.protocol.structured import StructuredOutput
from kvgate.protocol.tools import (
    FunctionCall,
    FunctionDefinition,
    NamedTool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Body):
    type: Literal["text", "input_text", "output_text"]
    text: str
    annotations: list[JsonValue] | None = None  # output_text echoed back by the Responses API


class FunctionCallParam(_Body):
    name: str
    arguments: str


class ToolCallParam(_Body):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def record(self) -> ToolCall:
        return ToolCall(
            id=self.id,
            function=FunctionCall(name=self.function.name, arguments=self.function.arguments),
        )


class Message(_Body):
    role: Annotated[str, Field(min_length=1, max_length=64)]  # system, developer, user, ...
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    refusal: None = None  # an assistant turn echoed back: only without a refusal
    function_call: None = None  # the deprecated form of tool_calls: not accepted
    audio: None = None

    def text(self) -> str | None:
        if self.content is None:
            return None
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def record(self) -> ChatMessage:
        # OpenAI's "developer" role is the system role of models that know no other.
        role = "system" if self.role == "developer" else self.role
        text = self.text()
        calls = [c.record() for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(
            role=role,
            content=text if text is not None or calls else "",
            name=self.name,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
        )


class FunctionParam(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, JsonValue] | None = None
    strict: bool | None = None


class ToolParam(_Body):
    type: Literal["function"]
    function: FunctionParam

    def record(self) -> ToolDefinition:
        f = self.function
        return ToolDefinition(
            function=FunctionDefinition(
                name=f.name, description=f.description, parameters=f.parameters, strict=f.strict
            )
        )


class _NamedFunction(_Body):
    name: str


class NamedToolChoiceParam(_Body):
    type: Literal["function"]
    function: _NamedFunction


ToolChoiceParam = Literal["none", "auto", "required"] | NamedToolChoiceParam


def tool_choice_record(choice: ToolChoiceParam | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, NamedToolChoiceParam):
        return NamedTool(name=choice.function.name)
    return ToolChoiceMode(choice)


class JsonSchemaParam(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # OpenAI's field is "schema"; pydantic's BaseModel has a deprecated attribute of that name.
    json_schema: dict[str, JsonValue] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always enforced here: the mask guarantees the schema

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaParam


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


def response_format_record(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """``response_format`` as the record's structured output (None: free text)."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput(json_object=True)
    schema = fmt.json_schema.json_schema
    if schema is None:
        return StructuredOutput(json_object=True)
    return StructuredOutput(json_schema=schema)


class StructuredOutputsParam(_Body):
    """vLLM's ``structured_outputs`` (its newer name for the ``guided_*`` fields)."""

    json_: JsonValue | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # kvgate's JSON never has free whitespace
    disable_additional_properties: bool | None = None
    whitespace_pattern: None = None
    structural_tag: None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def record(self) -> StructuredOutput:
        schema = self.json_
        if isinstance(schema, str):  # vLLM takes the schema as JSON text too
            schema = json.loads(schema)
        if schema is not None and not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return StructuredOutput(
            json_schema=schema,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
        )
