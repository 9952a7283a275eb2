"""Chat requests: ``messages`` (and ``tools``) rendered to prompt text through the model's chat
template.

The template is the Jinja2 source a model ships in ``tokenizer_config.json`` (``chat_template``);
the service reads it next to ``limits.tokenizer_file``. It runs in Jinja2's immutable sandbox, as
Hugging Face tokenizers run it: ``messages`` (role/content objects, with ``name``,
``tool_calls`` and ``tool_call_id`` where given), ``tools`` (OpenAI's function objects),
``add_generation_prompt`` (always true: the model writes the assistant's turn),
``bos_token``/``eos_token``, and ``raise_exception(message)`` for templates that refuse some
conversations.

A template that does not read ``tools`` (SmolLM2's, say) still gets its model told about them:
the tools go into the system message in the Hermes format (a ``<tools>`` list and the
``<tool_call>`` shape to answer in), which ``tool_parsers`` then reads back, and assistant turns
that called tools show their calls in that shape. Arguments reach templates as objects, as
Hugging Face templates expect (OpenAI sends them as JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.admission_service.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCallFormat,
    detect_format,
)
from kvgate.protocol.records import ChatMessage
from kvgate.protocol.tools import ToolCall, ToolDefinition

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

TOOL_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. You are provided with function signatures within <tools></tools> XML tags:"
    "\n<tools>\n{tools}\n</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or a template that cannot be loaded."""


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": _arguments(call)},
    }


def _hermes_calls(calls: Sequence[ToolCall]) -> str:
    return "\n".join(
        f"{HERMES_OPEN}\n"
        + json.dumps({"name": c.function.name, "arguments": _arguments(c)}, ensure_ascii=False)
        + f"\n{HERMES_CLOSE}"
        for c in calls
    )


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        try:
            from jinja2 import TemplateError, meta  # noqa: PLC0415 — optional: only chat needs it
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
        except ImportError as exc:
            raise ChatTemplateError(
                "chat templates need the 'jinja2' package (pip install jinja2)"
            ) from exc

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        self._template_error = TemplateError
        try:
            self._template = environment.from_string(source)
            variables = meta.find_undeclared_variables(environment.parse(source))
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        # Whether the template renders tools and tool calls itself (else kvgate's prompt does).
        self.renders_tools = "tools" in variables
        self.tool_call_format = detect_format(source if self.renders_tools else None)

    def _message(self, message: ChatMessage) -> dict[str, Any]:
        rendered: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            if self.renders_tools:
                rendered["tool_calls"] = [_call_dict(c) for c in message.tool_calls]
            else:
                text = message.content or ""
                rendered["content"] = (text + "\n" if text else "") + _hermes_calls(
                    message.tool_calls
                )
        if rendered["content"] is None and not self.renders_tools:
            rendered["content"] = ""
        return rendered

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] | None = None
    ) -> str:
        conversation = [self._message(m) for m in messages]
        extra: dict[str, Any] = {}
        if tools:
            tool_dicts = [t.model_dump(mode="json", exclude_none=True) for t in tools]
            if self.renders_tools:
                extra["tools"] = tool_dicts
            else:
                conversation = _with_tool_prompt(conversation, tool_dicts)
        try:
            return str(
                self._template.render(
                    messages=conversation, add_generation_prompt=True, **extra, **self._tokens
                )
            )
        except self._template_error as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def _with_tool_prompt(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the Hermes tool prompt in its system message (added first, or
    after an existing system message's text)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = TOOL_PROMPT.format(tools=listing)
    if conversation and conversation[0]["role"] == "system":
        first = dict(conversation[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


def resolve_format(template: ChatTemplate | None, configured: ToolCallFormat) -> ToolCallFormat:
    """The parser for ``auto`` tool choice: the configured one, else the template's."""
    if configured is not ToolCallFormat.AUTO:
        return configured
    return template.tool_call_format if template is not None else ToolCallFormat.HERMES


def _token_text(value: Any) -> str | None:
    """``bos_token`` and friends are a string or an AddedToken object with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(tokenizer_file: Path) -> ChatTemplate | None:
    """The template in ``tokenizer_config.json`` beside ``tokenizer_file``, if there is one."""
    path = tokenizer_file.parent / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from exc
    return chat_template_from_config(config) if isinstance(config, dict) else None


def chat_template_from_config(config: dict[str, Any]) -> ChatTemplate | None:
    """The template of a ``tokenizer_config.json`` dictionary, if it has one."""
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one serves chat
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )
