"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's ``tokenizer.*`` metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE (tokens, merges and token types in the metadata), split first by the
  pre-tokenizer ``tokenizer.ggml.pre`` names (:data:`BYTE_LEVEL_SPLITS`): GPT-2's regex
  (``default``/``gpt2``/``gpt-2``), SmolLM's (every digit alone, then GPT-2's), Llama 3's
  (``llama-bpe`` and the names llama.cpp treats as it: up to three digits a piece, a word whose
  text is a token is that token whole — ``ignore_merges``, as in Llama 3's ``tokenizer.json``)
  and Qwen 2's (single digits, NFC-normalized text, as Qwen's own tokenizer);
- ``llama``: SentencePiece-style (Llama 2, Mistral, Phi-3, Gemma), see :mod:`gguf_spm`.

Token types 2 (unknown) and 3 (control) are special added tokens, 4 (user-defined) plain added
tokens, all matched whole in the text before the model splits it (as llama.cpp and the
published ``tokenizer.json`` files do); special ones are dropped when decoding with
``skip_special_tokens``. BOS is added when ``tokenizer.ggml.add_bos_token`` says so, and when the
file is silent where llama.cpp adds it (SentencePiece vocabularies and Llama 3's); EOS when
``add_eos_token`` says so. Anything else is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.gguf_metadata import GgufMetadata
from kvgate.executor.gguf_spm import sentencepiece_tokenizer

UNKNOWN_TOKEN = 2
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
_SPECIAL_TYPES = (UNKNOWN_TOKEN, CONTROL_TOKEN)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class ByteLevelSplit:
    """How one ``tokenizer.ggml.pre`` value splits text before byte-level BPE."""

    regex: str | None  # None: GPT-2's own regex inside the byte-level step
    digits_first: bool = False  # every digit its own piece before the regex (SmolLM)
    nfc: bool = False  # text NFC-normalized first (Qwen 2's tokenizer)
    ignore_merges: bool = False  # a word that is a token is that token (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2 = ByteLevelSplit(regex=None)
_LLAMA3 = ByteLevelSplit(regex=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = ByteLevelSplit(regex=_QWEN2_SPLIT, nfc=True)
BYTE_LEVEL_SPLITS: dict[str, ByteLevelSplit] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": ByteLevelSplit(regex=None, digits_first=True),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        _LLAMA3,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
}
_SUPPORTED_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class SpecialTokens:
    """What ``tokenizer_config.json`` says about the vocabulary beyond the splitting rules."""

    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    chat_template: str | None
    add_eos_token: bool = False

    def tokenizer_config(self) -> dict[str, Any]:
        """A Hugging Face ``tokenizer_config.json`` dictionary."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
        }
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(self, key)
            if value is not None:
                config[key] = value
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config


def build_tokenizer(meta: GgufMetadata) -> tuple[Tokenizer, SpecialTokens]:
    """The tokenizer and its special tokens; raises CheckpointError for unsupported kinds.

    Phases: the token list; the model and its splitting (byte-level or SentencePiece); the added
    tokens; the special tokens and the BOS/EOS template.
    """
    name = meta.path.name
    kind = meta.get("tokenizer.ggml.model")
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise CheckpointError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        split = _byte_level_split(meta)
        tokenizer = _byte_level_tokenizer(meta, tokens, split)
        add_bos_default = split.add_bos
    elif kind == "llama":
        tokenizer, tokens, types = sentencepiece_tokenizer(meta, tokens, types)
        add_bos_default = True
    else:
        raise CheckpointError(
            f"{name}: tokenizer.ggml.model {kind!r} is not supported "
            f"(supported: {', '.join(_SUPPORTED_MODELS)})"
        )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] in _SPECIAL_TYPES, normalized=False)
            for i in range(len(tokens))
            if types[i] in (*_SPECIAL_TYPES, USER_DEFINED_TOKEN)
        ]
    )
    specials = _special_tokens(meta, tokens, add_bos_default)
    _add_bos_eos(tokenizer, specials, tokens)
    return tokenizer, specials


def _byte_level_split(meta: GgufMetadata) -> ByteLevelSplit:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    split = BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        raise CheckpointError(
            f"{meta.path.name}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(BYTE_LEVEL_SPLITS)})"
        )
    return split


def _byte_level_tokenizer(
    meta: GgufMetadata, tokens: list[str], split: ByteLevelSplit
) -> Tokenizer:
    name = meta.path.name
    merges = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        left, space, right = str(merge).partition(" ")
        if not space:
            raise CheckpointError(f"{name}: malformed BPE merge {merge!r}")
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{name}: the token list has duplicates")
    try:
        model = models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=split.ignore_merges
        )
    except Exception as exc:  # the library raises a bare Exception for inconsistent merges
        raise CheckpointError(f"{name}: the BPE vocabulary is inconsistent: {exc}") from exc
    tokenizer = Tokenizer(model)
    steps: list[Any] = []
    if split.digits_first:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split.regex is not None:
        steps.append(pre_tokenizers.Split(Regex(split.regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.regex is None))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    if split.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _special_tokens(meta: GgufMetadata, tokens: list[str], add_bos_default: bool) -> SpecialTokens:
    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise CheckpointError(
                f"{meta.path.name}: tokenizer.ggml.{key}_token_id {index} out of range"
            )
        return tokens[int(index)]

    return SpecialTokens(
        bos_token=token("bos"),
        eos_token=token("eos"),
        pad_token=token("padding"),
        unk_token=token("unknown"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=meta.get("tokenizer.chat_template"),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _add_bos_eos(tokenizer: Tokenizer, specials: SpecialTokens, tokens: list[str]) -> None:
    """The template that puts BOS before (and EOS after) an encoded text, when asked for."""
    ids = {tokens[i]: i for i in reversed(range(len(tokens)))}
    before = specials.bos_token if specials.add_bos_token else None
    after = specials.eos_token if specials.add_eos_token else None
    if before is None and after is None:
        return

    def around(body: str) -> str:
        return " ".join(part for part in (before, body, after) if part is not None)

    used = [t for t in (before, after) if t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=around("$A"),
        pair=f"{around('$A')} {around('$B')}",
        special_tokens=[(t, ids[t]) for t in dict.fromkeys(used)],
    )
