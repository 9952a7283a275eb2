"""Text prompts and text results through a ``tokenizer.json`` (the ``tokenizers`` package).

The service holds no model weights; it needs a tokenizer only to accept text prompts and to put
text into results. Without one, text prompts are rejected with a reason saying so.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class TokenizerError(ValueError):
    pass


class FileTokenizer:
    """A ``tokenizer.json``: encode without special tokens, decode skipping them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))


def load_tokenizer(path: Path) -> FileTokenizer:
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 — optional: only text prompts need it
    except ImportError as exc:
        raise TokenizerError(
            "limits.tokenizer_file needs the 'tokenizers' package (pip install tokenizers)"
        ) from exc
    if not path.is_file():
        raise TokenizerError(f"limits.tokenizer_file: {path} is not a file")
    try:
        return FileTokenizer(Tokenizer.from_file(str(path)))
    except Exception as exc:  # the library raises a bare Exception for malformed files
        raise TokenizerError(f"limits.tokenizer_file: {path} cannot be loaded: {exc}") from exc


class TokenizerThreads:
    """Tokenizes on ``threads`` worker threads, never on the event loop: a 1 MB text costs a
    real tokenizer 0.3-1.2 s, which on the loop would hold back every other request. The
    Rust tokenizer releases the GIL while it encodes, so the threads run in parallel."""

    def __init__(self, codec: TextCodec, threads: int) -> None:
        self._codec = codec
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgate-tokenize")

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._codec.encode, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
