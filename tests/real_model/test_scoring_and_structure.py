"""SmolLM2 on the executor: prompt scoring equals transformers' log-probabilities of the same
tokens (chunked fills, the first token without one), and JSON-schema outputs through the real
BPE vocabulary conform at temperature 0 and 1 through a swap and a recompute restore."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from kvgate.protocol.structured import StructuredOutput
from tests.executor.driver import Driver, DriverConfig

LOGIT_ATOL = 2e-3  # as test_golden: both sides fp32, kernels sum in another order

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population_millions", "capital"],
}


def test_prompt_logprobs_equal_transformers(
    kvgate_smollm2: LoadedModel, hf_model: Any, hf_tokenizer: Any
) -> None:
    prompt = hf_tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    request = wire.NewRequest(
        request_id="score", prompt_token_ids=prompt,
        sampling=wire.SamplingParams(max_tokens=1, prompt_logprobs=3),
    )  # fmt: skip
    executor = Executor(kvgate_smollm2, num_blocks=16, block_size=16)
    driver = Driver(executor, [(request, 1)], DriverConfig(chunk_size=5))
    driver.run()
    rows = [row for result in driver.results for row in result.prompt_logprobs]
    assert len(rows) > 1, "the fill ran in chunks, each reporting its positions"
    scored = {row.first_position + i: v for row in rows for i, v in enumerate(row.logprobs)}
    assert sorted(scored) == list(range(1, len(prompt)))
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position in range(1, len(prompt)):
        theirs = float(expected[position - 1, prompt[position]])
        assert abs(scored[position] - theirs) < LOGIT_ATOL, (position, scored[position], theirs)
    top = [t for row in rows for t in row.top_logprobs]
    best = torch.topk(expected[: len(prompt) - 1], 3, dim=-1).indices.tolist()
    assert [[t.token_id for t in entry] for entry in top] == best


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_conform_through_restores(
    kvgate_smollm2: LoadedModel, hf_tokenizer: Any, temperature: float
) -> None:
    grammar = StructuredOutput(json_schema=CITY).grammar_spec()
    chat = [{"role": "user", "content": "Describe Paris as JSON."}]
    text = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = hf_tokenizer.encode(text, add_special_tokens=False)
    requests = [
        (
            wire.NewRequest(
                request_id=f"json-{i}", prompt_token_ids=prompt,
                sampling=wire.SamplingParams(
                    temperature=temperature, seed=i, max_tokens=64, grammar=grammar
                ),
            ),
            1,
        )
        for i in range(2)
    ]  # fmt: skip
    executor = Executor(kvgate_smollm2, num_blocks=64, block_size=16, host_snapshot_blocks=64)
    config = DriverConfig(
        chunk_size=16, swap_after={"json-0": 5}, recompute_after={"json-1": 7}, async_plans=True
    )
    outputs = Driver(executor, requests, config).run()
    eos = kvgate_smollm2.model.config.eos_token_id
    for rid, (tokens, _) in outputs.items():
        assert tokens[-1] == eos, (rid, hf_tokenizer.decode(tokens))
        value = json.loads(hf_tokenizer.decode(tokens[:-1]))
        jsonschema.validate(value, CITY)
