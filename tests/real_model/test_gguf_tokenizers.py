"""Tokenizers rebuilt from GGUF metadata against two references built from the same vocabulary:
the published ``tokenizer.json`` layout of each model family loaded by transformers, and
transformers' own GGUF reader (where it follows the same rules; the differences are named).

Vocabularies: Llama 3's byte-level BPE (``llama-bpe``), Qwen 2's, SentencePiece as Llama 2 /
Mistral write it, and as Gemma does (:mod:`tests.real_model.gguf_vocabularies`).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import gguf
import pytest

from kvgate.executor.gguf_file import GgufFile
from kvgate.executor.gguf_tokenizer import build_tokenizer
from tests.real_model.gguf_vocabularies import TrainedVocabulary, trained_vocabulary
from tests.real_model.gguf_writer import Vocabulary, write_vocabulary
from tests.real_model.test_tokenizer_parity import CORPUS as SMOLLM_CORPUS

# A trained vocabulary and the (tensor-less) GGUF file holding it.
Trained = tuple[TrainedVocabulary, Path]
KINDS = ["llama-bpe", "qwen2", "spm", "spm-gemma"]
CORPUS = [
    *SMOLLM_CORPUS,
    "parenthetically speaking, kvgate parenthetically schedules",
    "cafe\u0301 and cafe\u0301s (a combining accent)",
    "the   three spaces and  two",
    "<tool>call<tool> and <s>inside</s>",
    "<|begin_of_text|>Hello<|eot_id|>",
    "\n\nnew lines first",
    "x" * 40 + " 1234567 " + "🙂" * 3,
]


def _gguf_file(vocabulary: Vocabulary, architecture: str, path: Path) -> Path:
    """A file with the vocabulary and no tensors (what the tokenizer reads)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    write_vocabulary(writer, vocabulary)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocabularies(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Trained]:
    out = {}
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(kind)
        trained = trained_vocabulary(kind, directory)
        out[kind] = (trained, _gguf_file(trained.gguf, trained.architecture, directory / "v.gguf"))
    return out


def _ours(path: Path) -> Any:
    tokenizer, _ = build_tokenizer(GgufFile(path).metadata)
    return tokenizer


def _published(trained: TrainedVocabulary) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(trained.reference))


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("kind", KINDS)
def test_encodes_and_decodes_as_the_published_layout(
    vocabularies: dict[str, Trained], kind: str, text: str
) -> None:
    trained, path = vocabularies[kind]
    ours, reference = _ours(path), _published(trained)
    expected = list(reference.encode(text, add_special_tokens=False))
    assert ours.encode(text, add_special_tokens=False).ids == expected
    decoded = reference.decode(expected, skip_special_tokens=True)
    assert ours.decode(expected, skip_special_tokens=True) == decoded


@pytest.mark.parametrize("kind", ["spm", "spm-gemma"])
def test_sentencepiece_merges_are_the_published_ones(
    vocabularies: dict[str, Trained], kind: str
) -> None:
    """The merges recovered from the scores (Gemma: from the pieces' order) are the reference's
    list, rank for rank (most corpus words end in the same pieces under either order)."""
    trained, path = vocabularies[kind]
    ours = json.loads(_ours(path).to_str())["model"]["merges"]
    theirs = json.loads(trained.reference.read_text())["model"]["merges"]
    assert ours == theirs


def _known_difference(kind: str, text: str) -> str | None:
    """Where transformers' GGUF reader follows other rules than the model's own tokenizer."""
    if kind == "llama-bpe" and "<|endoftext|>" in text:
        return "its byte-level reader adds GPT-2's <|endoftext|> to a vocabulary that has none"
    if kind == "llama-bpe" and "parenthetically" in text:
        return "its byte-level reader does not set Llama 3's ignore_merges"
    if kind == "qwen2" and unicodedata.normalize("NFC", text) != text:
        return "its byte-level reader does not NFC-normalize as Qwen 2's tokenizer does"
    if kind == "spm" and (text[:1].isspace() or any(s in text for s in ("<s>", "<|im", "<|"))):
        return (
            "its Llama reader prefixes a space only at the very start and never doubles one "
            "(Metaspace 'first'); the published Llama 2 / Mistral layout and llama.cpp prefix "
            "every segment"
        )
    return None


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("kind", KINDS)
def test_encodes_as_transformers_reads_the_gguf_file(
    vocabularies: dict[str, Trained], kind: str, text: str
) -> None:
    from transformers import AutoTokenizer

    difference = _known_difference(kind, text)
    if difference is not None:
        pytest.skip(difference)
    _, path = vocabularies[kind]
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = list(theirs.encode(text, add_special_tokens=False))
    assert _ours(path).encode(text, add_special_tokens=False).ids == expected


@pytest.mark.parametrize(
    ("kind", "bos_first"),
    [("llama-bpe", True), ("qwen2", False), ("spm", True), ("spm-gemma", True)],
)
def test_bos_is_added_where_llama_cpp_adds_it(
    vocabularies: dict[str, Trained],
    kind: str,
    bos_first: bool,
    tmp_path: Path,
) -> None:
    """A file without ``add_bos_token``: SentencePiece and Llama 3 vocabularies get BOS."""
    trained, _ = vocabularies[kind]
    silent = Vocabulary(**{**trained.gguf.__dict__, "add_bos": None})
    path = _gguf_file(silent, trained.architecture, tmp_path / "silent.gguf")
    tokenizer, specials = build_tokenizer(GgufFile(path).metadata)
    ids = tokenizer.encode("Hello world").ids
    assert specials.add_bos_token is bos_first
    assert (ids[0] == trained.gguf.bos_id) is bos_first
