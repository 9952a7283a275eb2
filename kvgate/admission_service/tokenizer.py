"""Text prompts and text results through a ``tokenizer.json`` (the ``tokenizers`` package).

The service holds no model weights; it needs a tokenizer only to accept text prompts and chat
messages and to put text into results. Without one, text prompts are rejected with a reason
saying so; a ``tokenizer_config.json`` beside the file supplies the chat template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvgate.admission_service.chat import (
    ChatTemplate,
    ChatTemplateError,
    chat_template_from_config,
    load_chat_template,
    resolve_format,
)
from kvgate.admission_service.tool_parsers import ToolCallFormat
from kvgate.protocol.records import ChatMessage
from kvgate.protocol.tokenizer_files import TokenizerFiles
from kvgate.protocol.tools import ToolDefinition

T = TypeVar("T")


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_with_special(self, token_ids: list[int]) -> str:
        """The text with special tokens written out (tool-call markers are special tokens in
        some models)."""
        ...

    def render_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] | None = None
    ) -> str:
        """Prompt text for a conversation; raises ChatTemplateError without a template."""
        ...

    def tool_call_format(self) -> ToolCallFormat:
        """The format ``auto`` tool calls are parsed in (never ``auto``)."""
        ...


class TokenizerError(ValueError):
    pass


class FileTokenizer:
    """A ``tokenizer.json``: encode without special tokens, decode skipping them."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: ChatTemplate | None = None,
        tool_call_format: ToolCallFormat = ToolCallFormat.AUTO,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._tool_call_format = resolve_format(chat_template, tool_call_format)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_with_special(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def render_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] | None = None
    ) -> str:
        if self._chat_template is None:
            raise ChatTemplateError(
                "this service's tokenizer has no chat template (tokenizer_config.json with "
                "chat_template beside limits.tokenizer_file); send a prompt instead"
            )
        return self._chat_template.render(messages, tools)

    def tool_call_format(self) -> ToolCallFormat:
        return self._tool_call_format


def load_tokenizer(
    path: Path, tool_call_format: ToolCallFormat = ToolCallFormat.AUTO
) -> FileTokenizer:
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 — optional: only text prompts need it
    except ImportError as exc:
        raise TokenizerError(
            "limits.tokenizer_file needs the 'tokenizers' package (pip install tokenizers)"
        ) from exc
    if not path.is_file():
        raise TokenizerError(f"limits.tokenizer_file: {path} is not a file")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for malformed files
        raise TokenizerError(f"limits.tokenizer_file: {path} cannot be loaded: {exc}") from exc
    try:
        return FileTokenizer(tokenizer, load_chat_template(path), tool_call_format)
    except ChatTemplateError as exc:
        raise TokenizerError(f"limits.tokenizer_file: {exc}") from exc


def tokenizer_from_files(
    files: TokenizerFiles, source: str, tool_call_format: ToolCallFormat = ToolCallFormat.AUTO
) -> FileTokenizer:
    """The tokenizer an executor served; ``source`` names it in errors."""
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 — optional: only text prompts need it
    except ImportError as exc:
        raise TokenizerError(
            "text prompts need the 'tokenizers' package (pip install tokenizers)"
        ) from exc
    try:
        tokenizer = Tokenizer.from_str(files.tokenizer_json)
    except Exception as exc:  # the library raises a bare Exception for malformed files
        raise TokenizerError(f"{source}: tokenizer.json cannot be loaded: {exc}") from exc
    try:
        template = chat_template_from_config(files.tokenizer_config)
        return FileTokenizer(tokenizer, template, tool_call_format)
    except ChatTemplateError as exc:
        raise TokenizerError(f"{source}: {exc}") from exc


class TokenizerThreads:
    """Tokenizes on ``threads`` worker threads, never on the event loop: a 1 MB text costs a
    real tokenizer 0.3-1.2 s, which on the loop would hold back every other request. The
    Rust tokenizer releases the GIL while it encodes, so the threads run in parallel."""

    def __init__(self, codec: TextCodec, threads: int) -> None:
        self._codec = codec
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgate-tokenize")

    async def call(self, work: Callable[[TextCodec], T]) -> T:
        """``work(codec)`` on a worker thread (tokenizing, rendering a chat template)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, work, self._codec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
