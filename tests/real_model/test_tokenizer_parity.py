"""kvgate's tokenizer rebuilt from the GGUF metadata splits and joins text exactly as the
tokenizer transformers converts from the same file (the reference), and so does the admission
service reading kvgate's converted ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate.admission_service.tokenizer import load_tokenizer as load_service_tokenizer
from kvgate.executor.gguf_file import GgufFile
from kvgate.executor.gguf_tokenizer import build_tokenizer
from kvgate.executor.tokenizer import TextTokenizer

CORPUS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "naïve café, Straße, Ærøskøbing, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and ZWJ sequences",
    "digits 1234567890, 3.14159, -42, 1e-5, 0x1F, 2026-12-01 21:00",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\tprint(f'{x!r}')\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "<|endoftext|><repo_name>kvgate<file_sep>README.md",
    "tabs\tand\nnewlines\r\n\n\nand  double  spaces",
    "mixed CamelCase snake_case kebab-case UPPER",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]


@pytest.fixture(scope="module")
def from_metadata(smollm2_gguf: Path) -> TextTokenizer:
    tokenizer, _ = build_tokenizer(GgufFile(smollm2_gguf).metadata)
    return TextTokenizer(tokenizer)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_and_decode_match_transformers(
    from_metadata: TextTokenizer, hf_tokenizer: Any, smollm2_dir: Path, text: str
) -> None:
    expected = list(hf_tokenizer.encode(text, add_special_tokens=False))
    assert from_metadata.encode(text) == expected
    service = load_service_tokenizer(smollm2_dir / "tokenizer.json")
    assert service.encode(text) == expected
    assert from_metadata.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_special_tokens_and_the_chat_template_match_transformers(
    smollm2_gguf: Path, hf_tokenizer: Any
) -> None:
    _, specials = build_tokenizer(GgufFile(smollm2_gguf).metadata)
    assert (specials.bos_token, specials.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert specials.eos_token == hf_tokenizer.eos_token
    assert specials.chat_template == hf_tokenizer.chat_template


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3×3 🙂?"},
    ],
    [{"role": "user", "content": "def f():\n    return '<|im_end|>'"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "turns", "markup"])
def test_the_service_renders_chat_as_transformers_does(
    smollm2_dir: Path, hf_tokenizer: Any, conversation: list[dict[str, str]]
) -> None:
    from kvgate.protocol.records import ChatMessage

    service = load_service_tokenizer(smollm2_dir / "tokenizer.json")
    text = service.render_chat([ChatMessage.model_validate(m) for m in conversation])
    expected = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    assert text == expected
    assert service.encode(text) == list(hf_tokenizer.encode(expected, add_special_tokens=False))
