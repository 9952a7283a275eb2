"""The executor under grammars, penalties and prompt scoring: a tiny random model with a byte
tokenizer writes JSON valid under a schema, a regex match or one of a choice at temperature 0 and
1, through chunked and wavefront fills, async plans, swap-out/in and recompute restores and a
migration to another executor, and always the tokens of the unpaged reference (so every restore
rebuilt its grammar state and its penalty counts from its outputs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.reference import reference_generate, reference_logits
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.grammar import TokenVocabulary
from kvgate.protocol import step as wire
from kvgate.protocol.structured import GrammarKind, GrammarSpec, StructuredOutput
from tests.executor.driver import Driver, DriverConfig
from tests.executor.test_executor_migration import TICKET, _move
from tests.executor.test_executor_migration import Driver as ManualDriver

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = make_tiny_model(tmp_path_factory.mktemp("bytes"), TinyModelSpec(seed=5))
    return load_model(directory)


@pytest.fixture(scope="module")
def vocabulary(byte_model: LoadedModel) -> TokenVocabulary:
    assert byte_model.tokenizer is not None
    config = byte_model.model.config
    assert config.eos_token_id is not None
    return TokenVocabulary(
        byte_model.tokenizer.to_json(),
        vocab_size=config.vocab_size,
        eos_token_id=config.eos_token_id,
    )


def _grammar(kind: str) -> GrammarSpec:
    if kind == "json":
        return StructuredOutput(json_schema=SCHEMA).grammar_spec()
    if kind == "regex":
        return GrammarSpec(kind=GrammarKind.REGEX, source=REGEX)
    return StructuredOutput(choice=CHOICES).grammar_spec()


def _requests(temperature: float) -> list[tuple[wire.NewRequest, int]]:
    prompts = [[104, 105, 32, 33] * 3, [65, 66], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    out = []
    for i, kind in enumerate(["json", "regex", "choice"]):
        sampling = wire.SamplingParams(
            temperature=temperature, seed=i, max_tokens=120, grammar=_grammar(kind)
        )
        out.append(
            (
                wire.NewRequest(request_id=kind, prompt_token_ids=prompts[i], sampling=sampling),
                1 + i,
            )
        )
    penalised = wire.SamplingParams(
        temperature=temperature, seed=9, max_tokens=24, presence_penalty=0.8,
        frequency_penalty=0.6, repetition_penalty=1.4, logit_bias={120: 3.0, 99: -100.0},
        min_tokens=20, min_p=0.05,
    )  # fmt: skip
    out.append(
        (wire.NewRequest(request_id="penalties", prompt_token_ids=[7, 7, 8], sampling=penalised), 2)
    )
    return out


def _check_text(kind: str, ids: list[int], loaded: LoadedModel, eos: int) -> None:
    assert loaded.tokenizer is not None
    assert ids and ids[-1] == eos, f"{kind}: the grammar ends with the EOS ({ids})"
    text = loaded.tokenizer.decode(ids)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


CONFIGS = {
    "plain": DriverConfig(chunk_size=64),
    "chunked-async": DriverConfig(chunk_size=3, async_plans=True, shuffle_seed=1),
    "swapped": DriverConfig(chunk_size=4, swap_after={"json": 3, "regex": 2, "penalties": 5}),
    "recomputed": DriverConfig(
        chunk_size=5, recompute_after={"json": 4, "choice": 1, "penalties": 6}, async_plans=True
    ),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_constrained_and_penalised_requests_match_the_reference_through_restores(
    byte_model: LoadedModel, vocabulary: TokenVocabulary, config: str, temperature: float
) -> None:
    eos = byte_model.model.config.eos_token_id
    assert eos is not None
    requests = _requests(temperature)
    executor = Executor(byte_model, num_blocks=256, block_size=4, host_snapshot_blocks=256)
    assert executor.info.structured_outputs
    got = Driver(executor, requests, CONFIGS[config]).run()
    for request, _ in requests:
        expected = reference_generate(
            byte_model.model, request, eos_token_id=eos, vocabulary=vocabulary
        )
        assert got[request.request_id][0] == expected.output_token_ids, request.request_id
        if request.request_id != "penalties":
            _check_text(request.request_id, got[request.request_id][0], byte_model, eos)
    penalised = got["penalties"][0]
    assert 99 not in penalised
    assert len(penalised) >= 20, "min_tokens holds the EOS back"


def test_a_migrated_constrained_request_resumes_its_grammar(
    byte_model: LoadedModel, vocabulary: TokenVocabulary
) -> None:
    eos = byte_model.model.config.eos_token_id
    assert eos is not None
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]  # the migration driver's
    sampling = wire.SamplingParams(
        temperature=1.0, seed=3, max_tokens=14, grammar=_grammar("regex")
    )
    request = wire.NewRequest(request_id="a", prompt_token_ids=prompt, sampling=sampling)
    expected = reference_generate(
        byte_model.model, request, eos_token_id=eos, vocabulary=vocabulary
    )
    tables = [[page for page in range(8)]]
    sender = ManualDriver(Executor(byte_model, num_blocks=64, block_size=4))
    sender.prefill(request, tables)
    sender.decode_to_boundary(3)
    sender.run(export=[wire.SnapshotExport(request_id="a", ticket=TICKET)])
    receiver = ManualDriver(
        Executor(byte_model, num_blocks=64, block_size=4, host_snapshot_blocks=64)
    )
    _move(sender.ex, receiver.ex)
    receiver.tokens = list(sender.tokens)
    receiver.run(
        adopt=[wire.SnapshotAdopt(request_id="a", ticket=TICKET)],
        swap_in=[wire.SwapIn(request_id="a", block_ids=[[20 + p for p in range(8)]])],
    )
    while receiver.tokens[-1][0] != eos and len(receiver.tokens) < 14:
        receiver.decode()
    assert [t for t, _ in receiver.tokens] == expected.output_token_ids
    _check_text("regex", expected.output_token_ids, byte_model, eos)


def test_prompt_logprobs_are_the_log_softmax_of_the_reference_logits(
    byte_model: LoadedModel,
) -> None:
    prompt = [5, 17, 200, 31, 9, 44, 100, 3, 250, 6, 71]
    request = wire.NewRequest(
        request_id="score", prompt_token_ids=prompt,
        sampling=wire.SamplingParams(max_tokens=1, prompt_logprobs=2),
    )  # fmt: skip
    executor = Executor(byte_model, num_blocks=64, block_size=4)
    driver = Driver(executor, [(request, 1)], DriverConfig(chunk_size=4))
    driver.run()
    rows = [p for r in driver.results for p in r.prompt_logprobs]
    assert [r.first_position for r in rows] == [1, 5, 9]  # one per chunk of four
    positions = [r.first_position + i for r in rows for i in range(len(r.logprobs))]
    assert positions == list(range(1, len(prompt)))
    logprobs = [v for r in rows for v in r.logprobs]
    # Position p's logits predict token p + 1: the reference's prefill of the first token, then
    # one decode per token.
    reference = torch.log_softmax(reference_logits(byte_model.model, prompt, 1), dim=-1)
    expected = [float(reference[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    top = [t for r in rows for t in r.top_logprobs]
    assert all(len(t) == 2 and t[0].logprob >= t[1].logprob for t in top)


def test_an_executor_without_a_tokenizer_refuses_a_grammar_in_the_plan(
    tmp_path: Path,
) -> None:
    directory = make_tiny_model(tmp_path, TinyModelSpec(vocab_size=128, seed=1))
    executor = Executor(load_model(directory), num_blocks=16, block_size=4)
    assert not executor.info.structured_outputs
    request = wire.NewRequest(
        request_id="x", prompt_token_ids=[1, 2],
        sampling=wire.SamplingParams(grammar=_grammar("regex")),
    )  # fmt: skip
    result = executor.execute(wire.StepPlan(step_id=1, new_requests=[request]))
    assert result.error is not None and "grammar" in result.error.message
