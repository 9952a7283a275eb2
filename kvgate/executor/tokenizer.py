"""Text <-> token ids through a ``tokenizer.json`` (the ``tokenizers`` library); no torch here.

Tiny test models get a byte-level tokenizer whose token id is the byte value (0-255), followed by
the special tokens ``<|bos|>`` and ``<|eos|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvgate.executor.config import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
BYTE_VOCAB_SIZE = 256
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"


class TextTokenizer:
    """A loaded tokenizer: ``encode`` without special tokens, ``decode`` skipping them."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (the grammar engine reads its vocabulary)."""
        return str(self._tokenizer.to_str())

    def save(self, model_dir: Path) -> None:
        self._tokenizer.save(str(model_dir / TOKENIZER_FILE))

    def token_id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return None if found is None else int(found)


def load_tokenizer(model_dir: Path) -> TextTokenizer | None:
    """The directory's tokenizer, or None when it has no ``tokenizer.json``."""
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TextTokenizer(Tokenizer.from_file(str(path)))
    except Exception as exc:  # the library raises a bare Exception for malformed files
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from exc


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves; every other byte
    is shifted past 255 so that no token text is whitespace or a control character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(BYTE_VOCAB_SIZE) if b not in mapping)
    for offset, byte in enumerate(shifted):
        mapping[byte] = chr(BYTE_VOCAB_SIZE + offset)
    return mapping


def build_byte_tokenizer() -> TextTokenizer:
    """Token ``b`` is byte ``b``; ``<|bos|>`` is 256 and ``<|eos|>`` is 257."""
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    return TextTokenizer(tokenizer)
