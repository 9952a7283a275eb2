"""Chat requests: ``messages`` rendered to prompt text through the model's chat template.

The template is the Jinja2 source a model ships in ``tokenizer_config.json`` (``chat_template``);
the service reads it next to ``limits.tokenizer_file``. It runs in Jinja2's immutable sandbox, as
Hugging Face tokenizers run it: ``messages`` (role/content objects), ``add_generation_prompt``
(always true: the model writes the assistant's turn), ``bos_token``/``eos_token``, and
``raise_exception(message)`` for templates that refuse some conversations.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.protocol.records import ChatMessage

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or a template that cannot be loaded."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        try:
            from jinja2 import TemplateError  # noqa: PLC0415 — optional: only chat needs it
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
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: Sequence[ChatMessage]) -> str:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return str(
                self._template.render(
                    messages=conversation, add_generation_prompt=True, **self._tokens
                )
            )
        except self._template_error as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


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
