"""Matching a request's output against its grammar, token by token, and the masks of allowed
next tokens for a batch of requests at once.

A :class:`TokenVocabulary` is a model's tokenizer as llguidance sees it (built once per
executor: about 0.3 s for SmolLM2's 49,152 tokens). A :class:`GrammarMatcher` is one request's
position in its grammar: it is created from the request's outputs so far (``replay``), so a
request restored by recompute or migrated to another executor resumes exactly where it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from kvgate.grammar.compile import compiled_grammar
from kvgate.protocol.structured import GrammarSpec

BITS_PER_WORD = 32


class TokenVocabulary:
    """A model's tokens for llguidance: its ``tokenizer.json`` text, the model's vocabulary size
    (at least the tokenizer's: rows past it are never allowed) and its EOS, the token a
    finished grammar allows."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id
        )
        self._executor = llguidance.LLExecutor()

    @property
    def mask_words(self) -> int:
        """int32 words per mask row (one bit per token)."""
        return (self.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD

    def matcher(self, spec: GrammarSpec, outputs: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for ``spec`` that has consumed ``outputs``."""
        matcher = GrammarMatcher(llguidance.LLMatcher(self._tokenizer, compiled_grammar(spec)))
        matcher.replay(outputs)
        return matcher

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask_ptr: int) -> None:
        """Write each matcher's allowed-next-token bits into row ``i`` of an int32
        ``[len(matchers), mask_words]`` C-contiguous buffer at ``bitmask_ptr``, in parallel on
        llguidance's own threads (the GIL is released meanwhile)."""
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                [(m.llmatcher, i) for i, m in enumerate(matchers)],
                bitmask_ptr,
                self.mask_words * 4,
                len(matchers),
            )


class GrammarMatcher:
    def __init__(self, llmatcher: llguidance.LLMatcher) -> None:
        self.llmatcher = llmatcher

    @property
    def error(self) -> str | None:
        """Why the matcher stopped matching (a token it could not take), or None."""
        return self.llmatcher.get_error() or None if self.llmatcher.is_error() else None

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: only the EOS may follow."""
        return bool(self.llmatcher.is_stopped())

    def replay(self, tokens: Sequence[int]) -> None:
        """Consume tokens already generated (a restore, a migration)."""
        for token in tokens:
            self.advance(token)

    def advance(self, token: int) -> None:
        """Consume one sampled token. The EOS after a finished grammar is not consumed (there
        is nothing left to match), so a request that goes on past it stays finished."""
        if self.is_finished:
            return
        self.llmatcher.consume_token(token)
