"""A ``GrammarSpec`` to llguidance's grammar text, once per distinct spec.

``compiled_grammar`` translates and validates; the result is cached by the spec (its kind and
source text), so thirty-two requests with one JSON schema compile it once. llguidance builds
its lexer and parser lazily per matcher, so what is cached is the translation and the check;
a matcher for a cached grammar costs well under a millisecond (docs/structured-outputs.md).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Final

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from kvgate.protocol.structured import GrammarKind, GrammarSpec

# Distinct grammars kept compiled; a request with one not kept is compiled again.
CACHED_GRAMMARS: Final = 1024
# JSON is written the way json.dumps writes it: ", " and ": " and no other whitespace. Flexible
# whitespace lets a weak model (or a random one) write newlines forever instead of the value.
JSON_OPTIONS: Final = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar engine refuses a schema, regex or grammar (the message says why)."""


# Integers every JSON reader holds exactly (JavaScript's safe integers).
SAFE_INTEGER_MAX: Final = 2**53 - 1
_SCHEMA_MAPS: Final = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE: Final = ("items", "not", "if", "then", "else", "contains", "additionalProperties")


def strict_schema(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing of others: what xgrammar's strict mode (vLLM's default) and
    OpenAI's strict schemas mean. Left open, a model may write keys of its own invention where
    a client expects exactly the listed ones (and a weak model never stops inventing them).
    Integers without bounds get JSON's safe-integer ones (16 digits at most)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: strict_schema(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [strict_schema(sub) for sub in closed[key]]
    for key in _SCHEMA_ONE:
        if key in closed:
            value = closed[key]
            closed[key] = (
                [strict_schema(v) for v in value]
                if isinstance(value, list)
                else strict_schema(value)
            )
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    if closed.get("type") == "integer":
        # An integer without bounds is one every JSON reader holds exactly; a weak model's
        # digits then end.
        closed.setdefault("minimum", -SAFE_INTEGER_MAX)
        closed.setdefault("maximum", SAFE_INTEGER_MAX)
    return closed


def _translate(spec: GrammarSpec) -> str:
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = strict_schema(json.loads(spec.source))
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from exc
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema),
                overrides=JSON_OPTIONS,  # type: ignore[arg-type]
            )
        )
    if spec.kind is GrammarKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    # Lark as it is; EBNF in llama.cpp's GBNF form is converted (a Lark text passes unchanged).
    try:
        lark = any_to_lark(spec.source)
    except Exception as exc:  # the converter raises bare exceptions for bad input
        raise GrammarError(f"the grammar is neither Lark nor EBNF: {exc}") from exc
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


@lru_cache(maxsize=CACHED_GRAMMARS)
def compiled_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec``; GrammarError naming the problem when it is invalid."""
    try:
        grammar = _translate(spec)
    except ValueError as exc:  # e.g. a schema that is not a JSON object
        raise GrammarError(str(exc)) from exc
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem.strip())
    return grammar


def grammar_problem(spec: GrammarSpec) -> str | None:
    """Why ``spec`` cannot be enforced, or None when it can."""
    try:
        compiled_grammar(spec)
    except GrammarError as exc:
        return str(exc)
    return None
