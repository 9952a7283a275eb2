"""The capacity rule at the model-length boundary, through the real executor.

A request of prompt ``P`` and ``max_tokens`` ``M`` fills ``P + M - 1`` KV positions (the last
sampled token is never fed back). At exactly ``max_model_len`` positions the scheduler admits it
and the executor must run it to the end; one position more is rejected on arrival with the
reason, before any step is planned. The scheduler takes ``max_model_len`` from the executor, as
the admission service does when a session opens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.reference import reference_generate
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol.enums import ModelFamily
from kvgate.protocol.step import ErrorCode, NewRequest, SamplingParams, StepPlan
from kvgate.sim.real import fit_to_model
from kvgate.sim.runner import run_once
from kvgate.sim.workload import CacheSection, ModelSection, Workload, WorkloadRequest

MAX_MODEL_LEN = 16
PROMPT_LEN = 8


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    spec = TinyModelSpec(
        family=ModelFamily.LLAMA, vocab_size=128, seed=3, max_position_embeddings=MAX_MODEL_LEN
    )
    directory = make_tiny_model(tmp_path_factory.mktemp("short"), spec)
    return load_model(Path(directory))


def _executor(loaded: LoadedModel) -> Executor:
    executor = Executor(loaded, num_blocks=16, block_size=4)
    assert executor.info.max_model_len == MAX_MODEL_LEN
    return executor


@pytest.mark.parametrize(
    ("max_tokens", "admitted"),
    [(MAX_MODEL_LEN - PROMPT_LEN, True), (MAX_MODEL_LEN - PROMPT_LEN + 1, True), (10, False)],
    ids=["one-below", "at-the-limit", "one-past"],
)
def test_the_model_length_boundary_holds_end_to_end(
    short_model: LoadedModel, max_tokens: int, admitted: bool
) -> None:
    assert PROMPT_LEN + max_tokens - 1 - MAX_MODEL_LEN in (-1, 0, 1)
    workload = Workload(
        model=ModelSection(vocab_size=128),
        cache=CacheSection(num_blocks=16, block_size=4),
        requests=[WorkloadRequest(id="edge", prompt_len=PROMPT_LEN, max_tokens=max_tokens)],
        max_steps=200,
    )
    workload = fit_to_model(workload, short_model)
    with torch.inference_mode():
        run = run_once(workload, executor=_executor(short_model))
    outcome = run.outcomes["edge"]
    if not admitted:
        assert outcome.status == "rejected"
        assert outcome.reason is not None and "exceeds max_model_len (16)" in outcome.reason
        assert run.steps == 0
        return
    assert outcome.status == "finished", outcome
    assert len(outcome.output_token_ids) == max_tokens
    prompt = list(workload.requests[0].prompt_tokens(workload.model))
    with torch.inference_mode():
        reference = reference_generate(
            short_model.model,
            NewRequest(
                request_id="edge",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            ),
            eos_token_id=None,
        )
    assert list(outcome.output_token_ids) == reference.output_token_ids


@pytest.mark.parametrize(("max_tokens", "accepted"), [(9, True), (10, False)])
def test_the_executor_validates_new_requests_with_the_same_rule(
    short_model: LoadedModel, max_tokens: int, accepted: bool
) -> None:
    executor = _executor(short_model)
    request = NewRequest(
        request_id="edge",
        prompt_token_ids=list(range(1, PROMPT_LEN + 1)),
        sampling=SamplingParams(max_tokens=max_tokens),
    )
    with torch.inference_mode():
        result = executor.execute(StepPlan(step_id=1, new_requests=[request]))
    if accepted:
        assert result.error is None
    else:
        assert result.error is not None and result.error.code is ErrorCode.BAD_PLAN
        assert "exceeds max_model_len (16)" in result.error.message
