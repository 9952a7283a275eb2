"""Structured outputs on the wire: what a client asks the text to be, and the one grammar the
executor masks the logits with.

Two shapes of one idea:

- :class:`StructuredOutput` is what a producer writes into an ``InferenceRequest`` (the OpenAI
  door maps ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` fields onto it):
  a JSON schema, any JSON object, a regular expression, a choice of strings, or a grammar in
  EBNF (GBNF) or Lark. Exactly one of them.
- :class:`GrammarSpec` is what travels to the executor in ``SamplingParams`` (once, with
  ``NewRequest``): one of three source kinds and its text. The admission service turns every
  request form (and a tool choice that forces a call) into one of these, so the executor compiles
  exactly three kinds, cached by ``(kind, source)``.

Both parse at the boundary; whether a schema, regex or grammar is *valid* is the grammar
engine's judgement, asked by the admission service before the request is queued
(``kvgate.grammar``), so an invalid one is a rejected request naming the problem and never a
failed step.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

# A JSON object as it arrived (a JSON schema, a function's parameters). Typed JSON, not Any.
JsonObject = dict[str, JsonValue]

MAX_CHOICES: Final = 256
MAX_GRAMMAR_CHARS: Final = 100_000


class GrammarKind(StrEnum):
    """The source languages the executor compiles (``kvgate.grammar.compile_grammar``)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema as JSON text
    REGEX = "regex"  # the whole output matches this regular expression
    GRAMMAR = "grammar"  # a context-free grammar in Lark or EBNF (GBNF) syntax


class GrammarSpec(BaseModel):
    """The grammar a request's output must stay inside (the executor's input)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GrammarKind
    source: Annotated[str, Field(min_length=1, max_length=4 * MAX_GRAMMAR_CHARS)]


ANY_JSON_OBJECT: Final = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source='{"type": "object"}')


class StructuredOutput(BaseModel):
    """What the generated text must be (exactly one field set), guaranteed by a token mask.

    ``json_schema``: a JSON document valid under this schema; ``json_object``: any JSON object;
    ``regex``: text the regular expression matches whole; ``choice``: exactly one of these
    strings; ``grammar``: text the grammar (Lark, or EBNF in llama.cpp's GBNF form) derives.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    json_schema: JsonObject | None = None
    json_object: bool = False
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=10_000)]],
            Field(min_length=1, max_length=MAX_CHOICES),
        ]
        | None
    ) = None
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [
            name
            for name, value in (
                ("json_schema", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json_schema, json_object, regex, choice and grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    def grammar_spec(self) -> GrammarSpec:
        """The one grammar the executor masks with."""
        if self.json_schema is not None:
            return GrammarSpec(
                kind=GrammarKind.JSON_SCHEMA, source=canonical_json(self.json_schema)
            )
        if self.json_object:
            return ANY_JSON_OBJECT
        if self.regex is not None:
            return GrammarSpec(kind=GrammarKind.REGEX, source=self.regex)
        if self.choice is not None:
            # A Lark start rule over JSON-quoted literals (Lark reads JSON string escapes).
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return GrammarSpec(kind=GrammarKind.GRAMMAR, source=f"start: {alternatives}")
        assert self.grammar is not None
        return GrammarSpec(kind=GrammarKind.GRAMMAR, source=self.grammar)


def canonical_json(value: JsonValue) -> str:
    """A JSON value as compact text: the grammar cache's key for a schema. Keys keep their order
    (a schema's ``properties`` order is the order the generated object writes them in)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
