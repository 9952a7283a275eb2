"""Seeded sampling checked against its specification, not against kvgate's own sampler.

The specification (``SamplingParams``): the token at ``position`` of request ``request_id`` is
drawn by inverse CDF, in token-id order, from the temperature / top-k / top-p renormalized
softmax, with one uniform from a ``torch.Generator`` seeded by the 63-bit little-endian blake2b-8
hash of ``"seed\\x1f{seed}\\x1f{position}"`` — or ``"id\\x1f{request_id}\\x1f{position}"`` when
the request sets no seed. The distribution and the draw are written here
from that text (numpy, float64) and the logits come from the test's own forward (``hf_forward``),
so a sampler that ignores the seed, shares a generator across rows, or filters wrongly fails.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.executor.sampler import SampleRow, sample
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig
from tests.executor.hf_forward import hf_last_logits

PROMPT = [17, 3, 99, 42, 8, 61, 5]
SAMPLED = wire.SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=12)


def spec_probs(logits: np.ndarray, params: wire.SamplingParams) -> np.ndarray:
    """The renormalized distribution the specification describes (float64)."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k is not None and params.top_k < scaled.size:
        kth = np.sort(scaled)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[before < params.top_p]] = True
        probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def spec_draw(probs: np.ndarray, seed: int | None, request_id: str, position: int) -> int:
    who = f"id\x1f{request_id}" if seed is None else f"seed\x1f{seed}"
    key = f"{who}\x1f{position}".encode()
    generator_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    generator = torch.Generator().manual_seed(generator_seed & (2**63 - 1))
    uniform = float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return min(index, int(np.nonzero(probs)[0][-1]))


@pytest.fixture(scope="module")
def forward(llama_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    config = json.loads((llama_dir / "config.json").read_text())
    return load_file(str(llama_dir / "model.safetensors")), config


def spec_generate(
    forward: tuple[dict[str, torch.Tensor], dict[str, object]],
    request_id: str,
    params: wire.SamplingParams,
) -> list[int]:
    tensors, config = forward
    outputs: list[int] = []
    while len(outputs) < params.max_tokens:
        logits = hf_last_logits(tensors, config, PROMPT + outputs).double().numpy()
        position = len(PROMPT) + len(outputs)
        if params.temperature == 0.0:
            outputs.append(int(np.argmax(logits)))
        else:
            outputs.append(spec_draw(spec_probs(logits, params), params.seed, request_id, position))
    return outputs


def _request(
    request_id: str, params: wire.SamplingParams, prompt: list[int] = PROMPT
) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=params.model_copy(update={"ignore_eos": True}),
    )


def _crowd() -> list[tuple[wire.NewRequest, int]]:
    others = [
        wire.SamplingParams(temperature=1.3, seed=1234, max_tokens=9),  # same seed, other id
        wire.SamplingParams(temperature=0.6, top_k=5, seed=1, max_tokens=14),
        wire.SamplingParams(max_tokens=6),
    ]
    return [
        (_request(f"other-{i}", params, [i + 1] * (3 + 4 * i)), 1 + i)
        for i, params in enumerate(others)
    ]


SCHEDULES = {
    "alone": (False, DriverConfig(chunk_size=64)),
    "crowd-chunked": (True, DriverConfig(chunk_size=3, shuffle_seed=4)),
    "crowd-async": (True, DriverConfig(chunk_size=5, async_plans=True)),
    "swapped": (True, DriverConfig(chunk_size=4, swap_after={"x": 4})),
    "recomputed": (True, DriverConfig(chunk_size=2, recompute_after={"x": 5})),
    "both": (False, DriverConfig(swap_after={"x": 2}, recompute_after={"x": 7})),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_seeded_request_draws_the_specified_tokens_in_any_schedule(
    llama: LoadedModel,
    forward: tuple[dict[str, torch.Tensor], dict[str, object]],
    schedule: str,
) -> None:
    crowd, cfg = SCHEDULES[schedule]
    requests = [(_request("x", SAMPLED), 2), *(_crowd() if crowd else [])]
    executor = Executor(llama, num_blocks=64, block_size=4, host_snapshot_blocks=32)
    outputs = Driver(executor, requests, cfg).run()
    assert outputs["x"][0] == spec_generate(forward, "x", SAMPLED)


def test_different_seeds_draw_different_sequences(llama: LoadedModel) -> None:
    """Same request id, same prompt, six seeds: six different sequences."""
    sequences = set()
    for seed in range(6):
        params = SAMPLED.model_copy(update={"seed": seed, "temperature": 1.0})
        executor = Executor(llama, num_blocks=16, block_size=4)
        outputs = Driver(executor, [(_request("x", params), 1)], DriverConfig()).run()
        sequences.add(tuple(outputs["x"][0]))
    assert len(sequences) == 6


def test_a_seed_reproduces_under_any_request_id_and_no_seed_draws_afresh(
    llama: LoadedModel,
    forward: tuple[dict[str, torch.Tensor], dict[str, object]],
) -> None:
    """As vLLM's per-request seed: the same prompt, settings and seed give the same tokens
    whatever the request is called; without a seed, two requests draw independently."""
    seeded = SAMPLED.model_copy(update={"temperature": 1.0})
    unseeded = seeded.model_copy(update={"seed": None})
    requests = [(_request(rid, seeded), 1) for rid in ("a", "b")]
    requests += [(_request(rid, unseeded), 1) for rid in ("c", "d")]
    executor = Executor(llama, num_blocks=64, block_size=4)
    outputs = Driver(executor, requests, DriverConfig()).run()
    assert outputs["a"][0] == outputs["b"][0] == spec_generate(forward, "a", seeded)
    assert outputs["c"][0] == spec_generate(forward, "c", unseeded)
    assert outputs["d"][0] == spec_generate(forward, "d", unseeded)
    assert outputs["c"][0] != outputs["d"][0]


def test_temperature_zero_is_greedy_whatever_the_seed_and_filters(
    llama: LoadedModel, forward: tuple[dict[str, torch.Tensor], dict[str, object]]
) -> None:
    greedy = spec_generate(forward, "x", wire.SamplingParams(max_tokens=10))
    for seed, top_k, top_p in [(0, None, 1.0), (77, 3, 0.5), (2**62, 1, 0.01)]:
        params = wire.SamplingParams(
            temperature=0.0, seed=seed, top_k=top_k, top_p=top_p, max_tokens=10
        )
        executor = Executor(llama, num_blocks=16, block_size=4)
        assert (
            Driver(executor, [(_request("x", params), 1)], DriverConfig()).run()["x"][0] == greedy
        )


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        wire.SamplingParams(temperature=0.7, seed=5),
        wire.SamplingParams(temperature=1.0, top_k=8, seed=6),
        wire.SamplingParams(temperature=1.2, top_p=0.85, seed=7),
        wire.SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=8),
    ],
    ids=["temperature", "top-k", "top-p", "top-k+top-p"],
)
def test_draws_follow_the_renormalized_softmax(
    forward: tuple[dict[str, torch.Tensor], dict[str, object]], params: wire.SamplingParams
) -> None:
    """Chi-square: 3000 draws (one per seed) against the specified distribution."""
    tensors, config = forward
    # The tiny model's logits have a spread of ~8 (near-greedy); scaled to ~1, many tokens count.
    logits = hf_last_logits(tensors, config, PROMPT) / 8.0
    expected = spec_probs(logits.double().numpy(), params)
    draws = 3000
    rows = [
        SampleRow("r", len(PROMPT), params.model_copy(update={"seed": params.seed + i}))
        for i in range(draws)
    ]
    counts = np.bincount(sample(logits.expand(draws, -1), rows), minlength=expected.size)
    assert counts[expected == 0.0].sum() == 0, "drew a token the filters exclude"
    expect = expected * draws
    big = expect >= 5.0
    observed = np.append(counts[big], counts[~big].sum())
    predicted = np.append(expect[big], expect[~big].sum())
    keep = predicted > 0
    statistic = float(((observed[keep] - predicted[keep]) ** 2 / predicted[keep]).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 3
    assert statistic < _chi_square_critical(dof), (statistic, dof)
