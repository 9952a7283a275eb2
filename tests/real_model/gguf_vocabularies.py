"""Tiny tokenizers trained with the ``tokenizers`` library, each in two forms: a Hugging Face
``tokenizer.json`` laid out as the published models' (the reference, loaded by transformers) and
the GGUF vocabulary llama.cpp's converter writes for it.

- ``llama-bpe``: Llama 3's layout: byte-level BPE, its split regex, ``ignore_merges`` (one vocab
  word no merge reaches, to show it), special tokens;
- ``qwen2``: Qwen 2's: its regex (single digits) and NFC normalization;
- ``spm``: Llama 2 / Mistral's SentencePiece layout (dummy-prefix normalizer, byte fallback,
  merges from the scores, as transformers derives them); ``spm-gemma``: Gemma's (no prefix,
  a user-defined piece of two spaces stored with real spaces, merges in file order, scores
  shuffled so that a ranking by score is another merge list).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from tests.real_model.gguf_writer import Vocabulary

SPACE = "\u2581"
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away quickly.",
    "def square(x: int) -> int:\n    return x ** 2  # squares a number\n",
    "for (int i = 0; i < n; ++i) { total += values[i]; }",
    "In 2026 there were 1234567 requests, 3.14159 of them irrational, 42 answered.",
    "naïve café Straße déjà vu, Ελληνικά και русский текст, 日本語のテキスト",
    "Hello, world! Hello again, world. Tokenizers split words, digits and punctuation.",
    "kvgate serves models; kvgate schedules requests and streams tokens back.",
] * 4
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
# Llama 3's tokenizer.json: this split, then byte-level; a word that is a token stays whole.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PublishedByteLevel:
    """The facts of a published byte-level ``tokenizer.json`` (written here, not read from
    kvgate, so that the comparison can fail)."""

    split: str
    nfc: bool
    ignore_merges: bool


def _published_byte_level(pre: str) -> PublishedByteLevel:
    if pre == "llama-bpe":
        return PublishedByteLevel(LLAMA3_SPLIT, nfc=False, ignore_merges=True)
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PublishedByteLevel(PRETOKENIZE_REGEX, nfc=True, ignore_merges=False)


UNREACHED_WORD = "Ġparenthetically"  # in the vocabulary, joined by no merge


@dataclass(frozen=True)
class TrainedVocabulary:
    reference: Path  # tokenizer.json in the published layout
    gguf: Vocabulary  # what the converter writes
    architecture: str  # general.architecture of the GGUF file


def _byte_level(pre: str, directory: Path) -> TrainedVocabulary:
    split = _published_byte_level(pre)
    steps = [
        pre_tokenizers.Split(Regex(split.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    vocab = dict(sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1]))
    merges = [tuple(m) for m in _merges_of(trainer_tokenizer)]
    if split.ignore_merges:
        vocab[UNREACHED_WORD] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if split.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    specials = LLAMA3_SPECIALS if pre == "llama-bpe" else ["<|endoftext|>", "<|im_start|>"]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    reference = directory / f"{pre}.json"
    tokenizer.save(str(reference))
    tokens = list(vocab) + specials
    gguf = Vocabulary(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        types=[1] * len(vocab) + [3] * len(specials),
        merges=[f"{left} {right}" for left, right in merges],
        bos_id=len(vocab),
        eos_id=len(vocab) + 1,
        add_bos=False,
    )
    return TrainedVocabulary(reference, gguf, "llama" if pre == "llama-bpe" else "qwen2")


def _merges_of(tokenizer: Tokenizer) -> list[list[str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m.split(" ") if isinstance(m, str) else m for m in merges]


def _sentencepiece(gemma: bool, directory: Path) -> TrainedVocabulary:
    """Pieces trained by BPE on ``▁``-joined words, laid out as SentencePiece does: control and
    byte pieces, merged pieces best first (score -rank), then single characters."""
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="always", split=True
    )
    trainer_tokenizer.train_from_iterator(
        TRAINING_TEXT, trainers.BpeTrainer(vocab_size=600, show_progress=False)
    )
    merges = _merges_of(trainer_tokenizer)
    merged = list(dict.fromkeys(left + right for left, right in merges))
    chars = [p for p in trainer_tokenizer.get_vocab() if len(p) == 1 and p not in merged]
    specials = (
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        if gemma
        else ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    )
    special_types = [3, 3, 3, 2, 3, 3] if gemma else [2, 3, 3, 3, 3]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    user_defined = ["  "] if gemma else ["<tool>"]
    pieces = specials + byte_pieces + user_defined + merged + sorted(chars)
    types = special_types + [6] * 256 + [4] * len(user_defined) + [1] * (len(merged) + len(chars))
    first = len(specials) + 256 + len(user_defined)
    scores = [0.0] * first + [-float(rank) for rank in range(len(pieces) - first)]
    if gemma:  # Gemma's scores do not follow its merge order (its pieces' order does)
        tail = scores[first:]
        random.Random(7).shuffle(tail)
        scores[first:] = tail
    vocab = {(SPACE * len(p) if p == "  " else p): i for i, p in enumerate(pieces)}
    reference_scores = {p: scores[i] for p, i in vocab.items() if types[i] == 1 or p == SPACE * 2}
    reference = _spm_reference(vocab, reference_scores, specials, gemma, directory)
    unknown = special_types.index(2)
    gguf = Vocabulary(
        model="llama",
        pre="default",
        tokens=pieces,
        types=types,
        scores=scores,
        bos_id=specials.index("<bos>" if gemma else "<s>"),
        eos_id=specials.index("<eos>" if gemma else "</s>"),
        unknown_id=unknown,
        add_bos=True,
        add_space_prefix=False if gemma else None,
    )
    return TrainedVocabulary(reference, gguf, "gemma2" if gemma else "llama")


def _spm_reference(
    vocab: dict[str, int],
    scores: dict[str, float],
    specials: list[str],
    gemma: bool,
    directory: Path,
) -> Path:
    """The published layout, merges from transformers' own derivation (ranked by the joined
    piece's score for Llama; by the piece's place in the vocabulary for Gemma)."""
    from transformers.tokenization_utils_base import generate_merges

    ranking = {p: -float(vocab[p]) for p in scores} if gemma else scores
    merges = generate_merges(vocab, ranking)
    unknown = "<unk>"
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True)
    )
    replace = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        replace if gemma else normalizers.Sequence([normalizers.Prepend(SPACE), replace])
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps if gemma else [*steps, decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if not gemma:
        tokenizer.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    reference = directory / ("spm-gemma.json" if gemma else "spm.json")
    tokenizer.save(str(reference))
    return reference


def trained_vocabulary(kind: str, directory: Path) -> TrainedVocabulary:
    if kind in ("llama-bpe", "qwen2"):
        return _byte_level(kind, directory)
    return _sentencepiece(kind == "spm-gemma", directory)
