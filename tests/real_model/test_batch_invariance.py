"""The executor's batch-invariant mode on the real SmolLM2: a request's tokens and logprobs are
the same bits whatever it shares its steps with and however its prompt is cut into chunks.

Each schedule runs the same two watched requests (one greedy, one sampled with a seed, both
reporting logprobs) through the real executor: alone with the whole prompt in one chunk; among
five other requests with chunks of 8 (mixed prefill and decode rows); among others with chunks
of 5 (a one-token last chunk) and plans made a step ahead. Without the mode the same schedules
differ in the last bits of the logprobs (oneDNN takes another kernel for a lone row, and the
attention kernel tiles prefill chunks), so these tests fail when either rule is dropped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.layer_ops import TorchLayerOps, prepare_cpu_kernels
from kvgate.executor.linear import LinearBackend
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.model import Model
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig

WATCHED = ("greedy", "sampled")
PROMPTS = {
    "greedy": "The lighthouse keeper climbed the stairs every evening, counting the steps as "
    "the wind pushed against the glass. Tonight the lamp would not light, and",
    "sampled": "Write a short note to a neighbour asking them to water the tomatoes while you "
    "are away for the weekend.",
    "other-0": "List three rivers of Europe.",
    "other-1": "A recipe for bread needs flour, water, salt and yeast. The first step is",
    "other-2": "Explain in one sentence why the sky looks blue during the day",
    "other-3": "Once upon a time",
    "other-4": "The committee met on Tuesday to discuss the budget for the new library, "
    "which had grown by a third since the first estimate in the spring",
}
SAMPLING = {
    "greedy": wire.SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5),
    "sampled": wire.SamplingParams(
        temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=3
    ),
}
OTHER = wire.SamplingParams(max_tokens=6, ignore_eos=True)
SCHEDULES = {
    "alone": (DriverConfig(chunk_size=512, mixed=False), ()),  # run once per watched request
    "mixed-chunks-of-8": (
        DriverConfig(chunk_size=8, shuffle_seed=5),
        ("other-0", "other-1", "other-2", "other-3", "other-4"),
    ),
    "async-chunks-of-5": (
        DriverConfig(chunk_size=5, async_plans=True, shuffle_seed=9),
        ("other-4", "other-2", "other-3"),
    ),
}

Watched = dict[str, list[tuple[int, float | None, list[tuple[int, float]]]]]


@pytest.fixture(scope="module", params=["float32", "quantized"])
def invariant_smollm2(request: pytest.FixtureRequest, smollm2_dir: Path) -> LoadedModel:
    """The model dequantized to float32, and as served by default: its GGUF blocks kept, float32
    activations (from 16 rows on their products go through oneDNN's GEMM unless the mode asks
    for every row alone)."""
    if not prepare_cpu_kernels().compiled:
        pytest.skip("kvgate's CPU kernels do not compile here (the mode needs them)")
    if request.param == "float32":
        return load_model(smollm2_dir, batch_invariant=True)
    return load_model(request.getfixturevalue("smollm2_gguf"), batch_invariant=True)


def _run(loaded: LoadedModel, schedule: str, watched: tuple[str, ...] = WATCHED) -> Watched:
    cfg, others = SCHEDULES[schedule]
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    requests = []
    for arrival, rid in enumerate((*others, *watched)):
        new = wire.NewRequest(
            request_id=rid,
            prompt_token_ids=tokenizer.encode(PROMPTS[rid]),
            sampling=SAMPLING.get(rid, OTHER),
        )
        # The watched requests arrive while the others are in prefill or decode.
        requests.append((new, arrival))
    executor = Executor(
        loaded, num_blocks=96, block_size=16, batch_invariant=loaded.model.batch_invariant
    )
    driver = Driver(executor, requests, cfg)
    with torch.inference_mode():
        driver.run()
    if others and cfg.mixed:
        assert driver.mixed_steps > 0, "no step mixed prefill and decode rows"
    tokens: Watched = {rid: [] for rid in watched}
    for result in driver.results:
        for token in result.sampled_tokens():
            if token.request_id in tokens:
                alternatives = [(t.token_id, t.logprob) for t in token.top_logprobs or []]
                tokens[token.request_id].append((token.token_id, token.logprob, alternatives))
    return tokens


def run_schedules(loaded: LoadedModel) -> tuple[Watched, dict[str, Watched]]:
    """Each watched request alone (its own executor, one row per step), then every schedule."""
    alone: Watched = {}
    for rid in WATCHED:
        alone |= _run(loaded, "alone", (rid,))
    return alone, {name: _run(loaded, name) for name in SCHEDULES if name != "alone"}


def test_watched_requests_are_bit_identical_in_every_schedule(
    invariant_smollm2: LoadedModel,
) -> None:
    alone, runs = run_schedules(invariant_smollm2)
    for rid in WATCHED:
        assert len(alone[rid]) == SAMPLING[rid].max_tokens
    for name, run in runs.items():
        for rid in WATCHED:
            for index, (got, want) in enumerate(zip(run[rid], alone[rid], strict=True)):
                assert got == want, f"{rid} token {index} in schedule {name!r}"


def test_the_mode_refuses_what_it_cannot_keep(kvgate_smollm2: LoadedModel) -> None:
    model = kvgate_smollm2.model
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        Model(model.config, model.weights, layer_ops=TorchLayerOps(), batch_invariant=True)
    with pytest.raises(ValueError, match="packed linears"):
        Model(model.config, model.weights, linear_backend=LinearBackend.TORCH, batch_invariant=True)
    with pytest.raises(ValueError, match="was loaded with batch_invariant=False"):
        Executor(kvgate_smollm2, num_blocks=8, batch_invariant=True)
