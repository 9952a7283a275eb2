"""Grammars for structured outputs, through llguidance: compiled once per text, validated at the
admission boundary (no tokenizer needed), matched token by token on the executor.

Torch-free: the admission service imports it to refuse an invalid schema or grammar before the
request is queued; the executor builds its token masks with it (``kvgate.executor.structured``).
Why llguidance and not xgrammar: docs/structured-outputs.md.
"""

from kvgate.grammar.compile import GrammarError, compiled_grammar, grammar_problem
from kvgate.grammar.matcher import GrammarMatcher, TokenVocabulary

__all__ = [
    "GrammarError",
    "GrammarMatcher",
    "TokenVocabulary",
    "compiled_grammar",
    "grammar_problem",
]
