"""Property: whatever the logits, every prefix the sampler draws under a grammar's masks stays
inside the grammar, and an output that ends on the EOS is a complete sentence of it.

Random logits stand for any model (the mask must hold for all of them); the masks, the batched
sampler and the matchers are the executor's own (``StructuredOutputs``). A second matcher,
fed the prefix from scratch, judges each prefix."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.executor.logits_processing import RowContext
from kvgate.executor.requests import RequestState
from kvgate.executor.sampler import SampleRow, sample
from kvgate.executor.structured import StructuredOutputs
from kvgate.executor.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_tokenizer
from kvgate.grammar import TokenVocabulary
from kvgate.protocol import step as wire
from kvgate.protocol.structured import GrammarKind, GrammarSpec, StructuredOutput

VOCAB = 272
TOKENIZER = build_byte_tokenizer()
EOS = TOKENIZER.token_id(EOS_TOKEN)
assert EOS is not None and TOKENIZER.token_id(BOS_TOKEN) is not None

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500},
     "ok": {"type": "boolean"}}, "required": ["n", "ok"]},
    {"type": "array", "items": {"enum": ["x", "yz", 3]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{1,5}$"},
     "o": {"type": "object", "properties": {"f": {"type": "number", "minimum": 0,
     "maximum": 1}}}}, "required": ["s"]},
]  # fmt: skip
REGEXES = [r"[0-9]{2,4}(-[a-z]{1,3})?", r"(yes|no|maybe)!?"]
GRAMMARS = ['start: "(" item ("," item)* ")"\nitem: /[a-d]/ | "(" item ")"']


def _specs() -> list[tuple[GrammarSpec, object]]:
    specs: list[tuple[GrammarSpec, object]] = [
        (StructuredOutput(json_schema=s).grammar_spec(), s) for s in SCHEMAS
    ]
    specs += [(GrammarSpec(kind=GrammarKind.REGEX, source=r), r) for r in REGEXES]
    specs += [(GrammarSpec(kind=GrammarKind.GRAMMAR, source=g), g) for g in GRAMMARS]
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def structured() -> StructuredOutputs:
    return StructuredOutputs(
        TOKENIZER, vocab_size=VOCAB, eos_token_id=EOS, device=torch.device("cpu")
    )


@pytest.fixture(scope="module")
def vocabulary() -> TokenVocabulary:
    assert EOS is not None
    return TokenVocabulary(TOKENIZER.to_json(), vocab_size=VOCAB, eos_token_id=EOS)


def _state(request_id: str, spec: GrammarSpec, temperature: float, seed: int) -> RequestState:
    sampling = wire.SamplingParams(temperature=temperature, seed=seed, max_tokens=64, grammar=spec)
    new = wire.NewRequest(request_id=request_id, prompt_token_ids=[1], sampling=sampling)
    return RequestState.register(new, num_loops=1, span_context=None)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(st.integers(0, len(SPECS) - 1), min_size=1, max_size=4),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
    seed=st.integers(0, 10_000),
)
def test_every_sampled_prefix_stays_inside_the_grammar(
    structured: StructuredOutputs,
    vocabulary: TokenVocabulary,
    picks: list[int],
    temperature: float,
    seed: int,
) -> None:
    states = [_state(f"r{i}", SPECS[p][0], temperature, seed + i) for i, p in enumerate(picks)]
    for state in states:
        structured.attach(state)
    generator = torch.Generator().manual_seed(seed)
    for step in range(64):
        live = [s for s in states if not s.outputs or s.outputs[-1] != EOS]
        if not live:
            break
        masks = structured.begin(live)
        rows = [
            SampleRow(
                s.request_id, step, s.sampling, RowContext(outputs=s.outputs, constrained=True)
            )
            for s in live
        ]
        logits = torch.randn(len(live), VOCAB, generator=generator) * 4
        allowed = structured.allowed(masks, [s.request_id for s in live])
        for state, token in zip(live, sample(logits, rows, allowed), strict=True):
            state.outputs.append(token)
            structured.advance(state, token)
            judge = vocabulary.matcher(state.sampling.grammar)  # type: ignore[arg-type]
            body = state.outputs[:-1] if token == EOS else state.outputs
            assert judge.llmatcher.try_consume_tokens(body) == len(body), state.outputs
            if token == EOS:
                assert judge.is_finished or judge.llmatcher.is_accepting()
    for state, pick in zip(states, picks, strict=True):
        if state.outputs and state.outputs[-1] == EOS:
            _check_complete(TOKENIZER.decode(state.outputs[:-1]), SPECS[pick])


def _check_complete(text: str, spec: tuple[GrammarSpec, object]) -> None:
    grammar, source = spec
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), source)  # type: ignore[arg-type]
    elif grammar.kind is GrammarKind.REGEX:
        assert re.fullmatch(str(source), text), text
    else:
        assert re.fullmatch(r"\((?:[a-d]|\(+[a-d]\)+)(?:,(?:[a-d]|\(+[a-d]\)+))*\)", text), text
