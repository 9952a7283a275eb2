"""Word-level tokenizers for tests: ``words`` words ``w0``.., their ids shuffled by ``seed``, so
two seeds give two tokenizers that encode the same text to different ids. 500 words and three
special tokens fit the simulated executor's vocabulary of 512."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def word_tokenizer(directory: Path, seed: int, words: int = 500) -> Path:
    """Writes ``tokenizer.json`` (and ``tokenizer_config.json`` with a chat template) into
    ``directory``; returns the tokenizer.json path."""
    ids = list(range(words))
    random.Random(seed).shuffle(ids)
    vocab = {f"w{i}": ids[i] for i in range(words)}
    vocab.update({"<user>": words, "<assistant>": words + 1, "[UNK]": words + 2})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "[UNK]"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path
