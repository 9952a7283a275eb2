"""The sampler: greedy, temperature, top-k, top-p, and draws keyed by (seed, request, position)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.reference import reference_generate
from kvgate.executor.sampler import (
    SampleRow,
    draw_seed,
    filtered_probs,
    logprob_fields,
    sample,
    sample_each,
)
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig
from tests.executor.hf_forward import hf_last_logits
from tests.executor.workloads import reference_outputs


def test_draw_seed_is_stable_and_separates_its_inputs() -> None:
    base = draw_seed(1, "r", 5)
    assert base == draw_seed(1, "r", 5)
    assert len({base, draw_seed(2, "r", 5), draw_seed(1, "r", 6)}) == 3
    # A seed keys the draw on its own: the request id does not enter.
    assert draw_seed(1, "s", 5) == base
    # Without a seed the id keys it, and never as a seed would: ("id", "1") vs (seed 1).
    assert len({draw_seed(None, "r", 5), draw_seed(None, "s", 5), draw_seed(None, "1", 5)}) == 3
    assert draw_seed(None, "1", 5) != base
    # No accidental aliasing between the fields: ("1", 23) and ("12", 3) differ.
    assert draw_seed(None, "1\x1f2", 3) != draw_seed(None, "1", 23)
    assert 0 <= base < 2**63


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    rows = [SampleRow("a", 0, wire.SamplingParams()), SampleRow("b", 0, wire.SamplingParams())]
    assert sample(logits, rows) == [1, 0]


def test_top_k_keeps_only_the_k_largest() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = filtered_probs(logits, wire.SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.1, 0.3, 0.1]))
    kept = filtered_probs(logits, wire.SamplingParams(temperature=1.0, top_p=0.75)) > 0
    assert kept.tolist() == [True, False, True, False]  # 0.5 + 0.3 >= 0.75
    kept = filtered_probs(logits, wire.SamplingParams(temperature=1.0, top_p=0.5)) > 0
    assert kept.tolist() == [True, False, False, False]  # the top token alone reaches 0.5
    kept = filtered_probs(logits, wire.SamplingParams(temperature=1.0, top_p=0.05)) > 0
    assert kept.tolist() == [True, False, False, False]  # the top token always survives


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = filtered_probs(logits, wire.SamplingParams(temperature=0.25))
    hot = filtered_probs(logits, wire.SamplingParams(temperature=4.0))
    assert cold[0] > 0.98 and hot[0] < 0.45


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs)
    params = wire.SamplingParams(temperature=1.0, seed=9)
    draws = 4000
    rows = [SampleRow("r", position, params) for position in range(draws)]
    tokens = sample(logits.expand(draws, 4), rows)
    frequency = torch.bincount(torch.tensor(tokens), minlength=4).float() / draws
    assert (frequency - probs).abs().max() < 0.03


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    params = wire.SamplingParams(temperature=1.0, top_p=0.9, seed=4)
    rows = [SampleRow(f"r{i}", 10 + i, params) for i in range(6)]
    together = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
    reversed_batch = sample(logits.flip(0), rows[::-1])[::-1]
    assert together == alone == reversed_batch


MIXED_PARAMS = [
    wire.SamplingParams(),  # greedy
    wire.SamplingParams(temperature=0.7, seed=1),
    wire.SamplingParams(temperature=1.3, top_k=5, seed=2),
    wire.SamplingParams(temperature=0.9, top_p=0.8),  # no seed: keyed by request id
    wire.SamplingParams(temperature=1.0, top_k=40, top_p=0.5, seed=3),
    wire.SamplingParams(temperature=0.0, top_k=3, seed=8),  # greedy whatever the filters
    wire.SamplingParams(temperature=2.0, top_p=0.999, seed=5),
    wire.SamplingParams(temperature=0.5, top_k=1, seed=6),
]


def test_the_batched_sampler_draws_what_the_per_row_one_does() -> None:
    """Every row of a mixed batch (greedy, temperatures, top-k, top-p, seeded or not) gets the
    token of :func:`sample_each`, which applies the rules one row at a time; peaked and flat
    rows, a vocabulary larger than top-k, and ties in the logits."""
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    logits = torch.randn(48, vocab, generator=gen) * torch.linspace(0.1, 8.0, 48).unsqueeze(1)
    logits[5, :20] = 3.0  # a tie across a top-k boundary
    rows = [SampleRow(f"r{i}", 7 + 3 * i, MIXED_PARAMS[i % len(MIXED_PARAMS)]) for i in range(48)]
    batched = sample(logits, rows)
    assert batched == sample_each(logits, rows)
    assert sample(logits[5:6], rows[5:6]) == batched[5:6]
    assert len(set(batched)) > 10  # the rows really draw


def test_batched_logprobs_are_each_rows_own() -> None:
    """The logprob fields of a batch, per row, are those of the row alone and match a float64
    log-softmax; rows that do not ask get none, and each gets as many alternatives as it asked."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 64, generator=gen) * 3
    asks = [2, None, 0, 5, 2]
    rows = [SampleRow(f"r{i}", i, wire.SamplingParams(logprobs=n)) for i, n in enumerate(asks)]
    tokens = [3, 1, 4, 1, 5]
    together = logprob_fields(logits, rows, tokens)
    for i, n in enumerate(asks):
        assert (
            together[i] == logprob_fields(logits[i : i + 1], rows[i : i + 1], tokens[i : i + 1])[0]
        )
        if n is None:
            assert together[i] == {}
            continue
        want = torch.log_softmax(logits[i].double(), dim=-1)
        assert together[i]["logprob"] == pytest.approx(float(want[tokens[i]]), abs=1e-5)
        top = together[i]["top_logprobs"]
        assert [t.token_id for t in top] == torch.argsort(want, descending=True)[:n].tolist()


def test_reference_decode_matches_full_recompute(llama_dir: Path, llama: LoadedModel) -> None:
    """The reference's KV handling: each greedy token equals the argmax of a from-scratch forward
    over the whole sequence so far."""
    config = json.loads((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    prompt = [4, 9, 33, 2, 71]
    request = wire.NewRequest(
        request_id="r", prompt_token_ids=prompt, sampling=wire.SamplingParams(max_tokens=6)
    )
    outputs = reference_generate(llama.model, request).output_token_ids
    for i, token in enumerate(outputs):
        logits = hf_last_logits(tensors, config, prompt + outputs[:i])
        assert int(logits.argmax()) == token


def _model_with_eos(source: Path, target: Path, eos: int) -> LoadedModel:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = eos
    (target / "config.json").write_text(json.dumps(config))
    return load_model(target)


def test_eos_stops_generation_and_rows_after_it_are_skipped(
    llama_dir: Path, llama: LoadedModel, tmp_path: Path
) -> None:
    prompt = [7, 8, 9]
    probe = wire.NewRequest(
        request_id="stop",
        prompt_token_ids=prompt,
        sampling=wire.SamplingParams(max_tokens=12, ignore_eos=True),
    )
    eos = reference_generate(llama.model, probe).output_token_ids[3]
    model = _model_with_eos(llama_dir, tmp_path / "eos", eos)
    stopping = probe.model_copy(update={"sampling": wire.SamplingParams(max_tokens=12)})
    requests = [(stopping, 1), (probe.model_copy(update={"request_id": "ignore"}), 1)]
    expected = reference_outputs(model, requests)
    outputs_stop = expected["stop"][0]
    assert outputs_stop[-1] == eos and len(outputs_stop) <= 4
    assert len(expected["ignore"][0]) == 12

    executor = Executor(model, num_blocks=64, block_size=4)
    driver = Driver(executor, requests, DriverConfig(chunk_size=2, async_plans=True))
    assert driver.run() == expected
    skipped = [rid for result in driver.results for rid in result.skipped_request_ids]
    # Each request had one placeholder row planned before its end (EOS, max_tokens) was known.
    assert sorted(skipped) == ["ignore", "stop"]
