"""The checks every dense family passes against transformers, shared by the per-family test
files (test_family_*.py) and the slow matrix (test_family_matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig
from tests.executor.hf_checkpoints import (
    MAX_TOKENS,
    Written,
    as_transformers_4,
    cached_greedy,
    config_of,
    copy_with_config,
    kvgate_greedy,
)

# Batched prompts prefilled in chunks of 5 on one block table each, mixed with decode rows; the
# first request swapped out to the host and back after 4 outputs, the second freed and
# recomputed from its prompt and outputs after 6.
CORE = DriverConfig(chunk_size=5, swap_after={"r0": 4}, recompute_after={"r1": 6})
SNAPSHOT_BLOCKS = 96

# Log-probabilities of tiny fp32 models: kvgate's paged kernels, fused projections and compiled
# norms against transformers' eager forward differ in summation order only.
LOGPROB_ATOL = 2e-4


def assert_core(written: Written) -> None:
    """transformers' greedy ids through the real executor: batched, chunked, preempted."""
    got = kvgate_greedy(
        written.model_dir, written.prompts, CORE, host_snapshot_blocks=SNAPSHOT_BLOCKS
    )
    assert got == written.greedy_ids


def assert_old_layout(written: Written, tmp_path: Path) -> None:
    """The same weights under the config.json transformers 4 wrote: the same ids."""
    old = copy_with_config(
        written.model_dir, tmp_path / "v4", as_transformers_4(config_of(written.model_dir))
    )
    assert "rope_parameters" not in config_of(old)
    assert kvgate_greedy(old, written.prompts) == written.greedy_ids


def _hf_logits(written: Written, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), V]`` of transformers' model over ``ids``: one forward, or (for
    RoPE that depends on the call's length) its KV cache one position at a time."""
    model = written.model
    with torch.no_grad():
        if written.greedy is not cached_greedy:
            return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        rows = []
        for position, token in enumerate(ids):
            out = model(
                torch.tensor([[token]]),
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[position]]),
            )
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)


def assert_logprobs_close(written: Written, loaded: LoadedModel | Path) -> None:
    """Every prompt and output position's top-5 log-probabilities, through the executor, within
    LOGPROB_ATOL of transformers' log-softmax."""
    sampling = wire.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    requests = [
        (wire.NewRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling), i)
        for i, p in enumerate(written.prompts)
    ]
    executor = Executor(loaded, num_blocks=96, block_size=4)
    driver = Driver(executor, requests, DriverConfig(chunk_size=5))
    driver.run()
    for i, prompt in enumerate(written.prompts):
        rid = f"r{i}"
        outputs = driver.outputs()[rid][0]
        expected = torch.log_softmax(_hf_logits(written, prompt + outputs[:-1]), dim=-1)
        got: dict[int, list[tuple[int, float]]] = {}
        for result in driver.results:
            for token in result.sampled_tokens():
                if token.request_id == rid:
                    got[token.position] = _top(token.top_logprobs)
            for chunk in result.prompt_logprobs:
                if chunk.request_id == rid:
                    for offset, top in enumerate(chunk.top_logprobs):
                        got[chunk.first_position + offset] = _top(top)
        # Position p's distribution is the row of the token before it.
        assert sorted(got) == list(range(1, len(prompt) + len(outputs)))
        for position, top in got.items():
            row = expected[position - 1]
            for token_id, logprob in top:
                assert abs(logprob - float(row[token_id])) <= LOGPROB_ATOL, (rid, position)


def _top(top: Any) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in top or []]


def watched_bits(loaded: LoadedModel, prompts: list[list[int]], schedule: str) -> list[Any]:
    """A watched request's (token, logprob, top logprobs), alone or among the other prompts
    (mixed prefill and decode rows; chunks of 3 planned a step ahead)."""
    watched = wire.NewRequest(
        request_id="watched",
        prompt_token_ids=prompts[1],
        sampling=wire.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4),
    )
    sampling = wire.SamplingParams(max_tokens=6, ignore_eos=True)
    others = [
        wire.NewRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling)
        for i, p in enumerate(prompts)
    ]
    requests = [watched] if schedule == "alone" else [*others, watched]
    cfg = {
        "alone": DriverConfig(chunk_size=64, mixed=False),
        "mixed": DriverConfig(chunk_size=5, shuffle_seed=3),
        "async": DriverConfig(chunk_size=3, async_plans=True),
    }[schedule]
    executor = Executor(loaded, num_blocks=96, block_size=4, batch_invariant=True)
    driver = Driver(executor, [(r, i) for i, r in enumerate(requests)], cfg)
    driver.run()
    return [
        (token.token_id, token.logprob, [(t.token_id, t.logprob) for t in token.top_logprobs or []])
        for result in driver.results
        for token in result.sampled_tokens()
        if token.request_id == "watched"
    ]


def assert_batch_invariant(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    """The batch-invariant mode gives the watched request the same bits in every schedule."""
    alone = watched_bits(loaded, prompts, "alone")
    assert len(alone) == 8
    for schedule in ("mixed", "async"):
        assert watched_bits(loaded, prompts, schedule) == alone, schedule
