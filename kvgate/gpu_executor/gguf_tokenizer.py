"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's ``tokenizer.*`` metadata.

Supported: ``tokenizer.ggml.model = gpt2`` (byte-level BPE: tokens, merges and token types in the
metadata) with the pre-tokenizers ``gpt2``/``default`` (the GPT-2 split regex) and ``smollm``
(every digit its own piece first, then the GPT-2 regex). Token types 3 (control) and 4
(user-defined) are added tokens matched before BPE; control tokens are special (dropped when
decoding with ``skip_special_tokens``). Anything else is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvgate.gpu_executor.config import CheckpointError
from kvgate.gpu_executor.gguf_file import GgufMetadata

CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


@dataclass(frozen=True)
class SpecialTokens:
    """What ``tokenizer_config.json`` says about the vocabulary beyond the splitting rules."""

    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    chat_template: str | None

    def tokenizer_config(self) -> dict[str, Any]:
        """A Hugging Face ``tokenizer_config.json`` dictionary."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
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


def _pre_tokenizer(kind: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def build_tokenizer(meta: GgufMetadata) -> tuple[Tokenizer, SpecialTokens]:
    """The tokenizer and its special tokens; raises CheckpointError for unsupported kinds."""
    name = meta.path.name
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"{name}: tokenizer.ggml.model {model!r} is not supported (supported: gpt2)"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(
            f"{name}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise CheckpointError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
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
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as exc:  # the library raises a bare Exception for inconsistent merges
        raise CheckpointError(f"{name}: the BPE vocabulary is inconsistent: {exc}") from exc
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == CONTROL_TOKEN, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL_TOKEN, USER_DEFINED_TOKEN)
        ]
    )

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise CheckpointError(f"{name}: tokenizer.ggml.{key}_token_id {index} out of range")
        return tokens[int(index)]

    bos = token("bos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    specials = SpecialTokens(
        bos_token=bos,
        eos_token=token("eos"),
        pad_token=token("padding"),
        unk_token=token("unknown"),
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
    )
    return tokenizer, specials
