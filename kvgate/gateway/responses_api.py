"""``POST /v1/responses``, stateless: OpenAI's Responses API over the same Kafka request as a
chat completion.

A body's ``instructions`` and ``input`` (a string, or items: messages, the model's earlier
``function_call`` items and the client's ``function_call_output`` items) become the record's
messages; ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls`` and
``text.format`` (text, JSON object, JSON schema) its tools and structured output; the answer is
a ``response`` object whose ``output`` holds a message item and/or ``function_call`` items.
Nothing is kept: ``store`` is accepted and the response says ``store: false``;
``previous_response_id`` and ``conversation`` (which need a stored response) are refused.

Streaming sends the Responses events (``response.created`` ... ``response.output_text.delta``
... ``response.completed``), each with its ``sequence_number``; text deltas come from the same
assembler as chat's (so tool calls are held back and stop strings respected).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue

from kvgate.admission_service.tokenizer import TextCodec
from kvgate.gateway.chat_fields import (
    FunctionParam,
    JsonSchemaParam,
    Message,
    TextPart,
    ToolCallParam,
    ToolParam,
    _Body,
)
from kvgate.gateway.openai_api import (
    ApiError,
    ChatBody,
    Mapped,
    bad_field,
    to_request,
)
from kvgate.gateway.responses import choices_of
from kvgate.gateway.streaming import StreamAssembler
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.records import REQUEST_ID_PATTERN, InferenceResult, ReplyTo, TokenChunk


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, JsonValue] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, JsonValue] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = _Body.model_config | {"populate_by_name": True}


class TextConfig(_Body):
    format: (
        Annotated[
            TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    verbosity: Literal["medium"] | None = None


class Reasoning(_Body):
    effort: None = None
    summary: None = None


class ResponsesBody(_Body):
    model: Annotated[str, Field(min_length=1)]
    input: str | list[dict[str, JsonValue]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored (the response says store: false)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    background: Literal[False] | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    max_tool_calls: None = None
    # kvgate's extensions, as on the other doors.
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    priority: int | None = None
    deadline_unix_s: Annotated[float, Field(gt=0)] | None = None
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = None

    def check_neutral(self) -> None:
        if self.include:
            raise bad_field("include", "no additional output data can be included here")

    def messages(self) -> list[Message]:
        """``instructions`` and ``input`` as chat messages (function calls grouped into the
        assistant turn that made them)."""
        out: list[Message] = []
        if self.instructions:
            out.append(Message(role="system", content=self.instructions))
        if isinstance(self.input, str):
            out.append(Message(role="user", content=self.input))
            return out
        calls: list[ToolCallParam] = []
        for index, raw in enumerate(self.input):
            item = _input_item(raw, index)
            if isinstance(item, FunctionCallItem):
                calls.append(
                    ToolCallParam.model_validate(
                        {"id": item.call_id,
                         "function": {"name": item.name, "arguments": item.arguments}}
                    )
                )  # fmt: skip
                continue
            if calls:
                out.append(Message(role="assistant", content=None, tool_calls=calls))
                calls = []
            if isinstance(item, FunctionCallOutputItem):
                output = item.output
                text = output if isinstance(output, str) else "".join(p.text for p in output)
                out.append(Message(role="tool", content=text, tool_call_id=item.call_id))
            else:
                out.append(Message(role=item.role, content=item.content))
        if calls:
            out.append(Message(role="assistant", content=None, tool_calls=calls))
        return out

    def chat_body(self) -> ChatBody:
        """The chat completion this response is."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "priority": self.priority,
            "deadline_unix_s": self.deadline_unix_s,
            "request_id": self.request_id,
        }
        if self.top_logprobs is not None:
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        if self.tools:
            fields["tools"] = [
                ToolParam(
                    type="function",
                    function=FunctionParam(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters,
                        strict=t.strict,
                    ),
                )
                for t in self.tools
            ]
            choice = self.tool_choice
            if isinstance(choice, NamedFunctionChoice):
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            elif choice is not None:
                fields["tool_choice"] = choice
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJsonObject):
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, TextFormatJsonSchema):
            param = JsonSchemaParam(name=fmt.name, json_schema=fmt.schema_, strict=fmt.strict)
            fields["response_format"] = {"type": "json_schema", "json_schema": param}
        return ChatBody.model_validate({k: v for k, v in fields.items() if v is not None})


def _input_item(
    raw: dict[str, JsonValue], index: int
) -> InputMessage | FunctionCallItem | FunctionCallOutputItem:
    kind = raw.get("type", "message")
    models: dict[object, type[_Body]] = {
        "message": InputMessage, "function_call": FunctionCallItem,
        "function_call_output": FunctionCallOutputItem,
    }  # fmt: skip
    model = models.get(kind)
    if model is None:
        raise bad_field(f"input.{index}.type", f"input items of type {kind!r} are not supported")
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValueError as exc:
        raise bad_field(f"input.{index}", f"input.{index}: {exc}") from None


def to_responses_request(
    body: ResponsesBody, *, request_id: str, priority: int, default_max_tokens: int, reply: ReplyTo
) -> Mapped:
    try:
        chat = body.chat_body()
    except ValueError as exc:
        raise ApiError(400, f"the input cannot be read: {exc}", param="input") from None
    mapped = to_request(
        chat, request_id=request_id, priority=priority, default_max_tokens=default_max_tokens,
        reply=reply,
    )  # fmt: skip
    if body.stream:
        request = mapped.request.model_copy(
            update={"reply": mapped.request.reply.model_copy(update={"tokens": True})}  # type: ignore[union-attr]
        )
        return Mapped(
            request, mapped.top_logprobs, True, False, tools_auto=mapped.tools_auto,
            forced_tool=mapped.forced_tool,
        )  # fmt: skip
    return mapped


# --------------------------------------------------------------------------- the response


def _usage(result: InferenceResult) -> dict[str, Any]:
    u = result.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def output_items(result: InferenceResult) -> list[dict[str, Any]]:
    choice = choices_of(result)[0]
    rid = result.request_id
    items: list[dict[str, Any]] = []
    if choice.text or not choice.tool_calls:
        items.append(_message_item(f"msg_{rid}", choice.text or "", "completed"))
    for call in choice.tool_calls or []:
        items.append(
            {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id,
             "name": call.function.name, "arguments": call.function.arguments,
             "status": "completed"}
        )  # fmt: skip
    return items


def response_object(
    result: InferenceResult | None,
    body: ResponsesBody,
    model: str,
    created: int,
    request_id: str,
    *,
    status: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object (in progress while ``result`` is None)."""
    incomplete = None
    if result is not None and status is None:
        cut = result.finish_reason is FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        incomplete = {"reason": "max_output_tokens"} if cut else None
    text_format: Any = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
    tool_choice: Any = body.tool_choice or "auto"
    if isinstance(tool_choice, NamedFunctionChoice):
        tool_choice = tool_choice.model_dump()
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": created,
        "status": status or "in_progress",
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output_items(result) if result is not None else [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": text_format},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": _usage(result) if result is not None else None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


class ResponseStream:
    """The Responses API's stream events for one request."""

    def __init__(
        self, body: ResponsesBody, mapped: Mapped, codec: TextCodec | None, model: str
    ) -> None:
        self.body = body
        self.model = model
        self.request_id = mapped.request.request_id
        self.created = int(time.time())
        self.item_id = f"msg_{self.request_id}"
        self._chat = StreamAssembler(mapped, codec, model, chat=True)
        self._sequence = 0
        self._text = ""
        self._opened_text = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _open_text(self) -> list[dict[str, Any]]:
        if self._opened_text:
            return []
        self._opened_text = True
        return [
            self._event("response.output_item.added", output_index=0,
                        item=_message_item(self.item_id, "", "in_progress") | {"content": []}),
            self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []}),
        ]  # fmt: skip

    def opening(self) -> list[dict[str, Any]]:
        started = response_object(None, self.body, self.model, self.created, self.request_id)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def token(self, chunk: TokenChunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in self._chat.token(chunk):
            delta = piece["choices"][0]["delta"].get("content") if piece["choices"] else None
            if delta:
                events += self._open_text()
                self._text += delta
                events.append(
                    self._event("response.output_text.delta", item_id=self.item_id,
                                output_index=0, content_index=0, delta=delta, logprobs=[])
                )  # fmt: skip
        return events

    def finish(self, result: InferenceResult) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        items = output_items(result)
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                events += self._open_text()
                if text.startswith(self._text) and len(text) > len(self._text):
                    events.append(
                        self._event("response.output_text.delta", item_id=self.item_id,
                                    output_index=index, content_index=0,
                                    delta=text[len(self._text) :], logprobs=[])
                    )  # fmt: skip
                events += [
                    self._event("response.output_text.done", item_id=self.item_id,
                                output_index=index, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.item_id,
                                output_index=index, content_index=0,
                                part={"type": "output_text", "text": text, "annotations": []}),
                ]  # fmt: skip
            else:
                events += [
                    self._event("response.output_item.added", output_index=index,
                                item=item | {"arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"]),
                ]  # fmt: skip
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        done = response_object(result, self.body, self.model, self.created, self.request_id)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=done))
        return events


def json_text(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
