"""kvgate on SmolLM2-135M-Instruct against transformers reading the same GGUF file on its own.

Two kvgate paths: the model dequantized to float32 (``--dtype float32``) and the default, its
blocks kept as stored and multiplied with float32 activations (each block dequantized in the
dot product). Greedy token ids must be equal for every prompt (plain text and chat through the
template), whether the prompts run batched, in small chunks arriving over time, or are swapped
out or freed and recomputed in the middle of decode. Logits must agree within ``LOGIT_ATOL``
(both sides fp32; what remains is summation order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.reference import reference_logits
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType
from tests.executor.driver import Driver, DriverConfig

EOS = 2
MAX_TOKENS = 8
# Largest |kvgate - transformers| over a logits row of magnitude ~20, fp32 on CPU. Measured:
# below 1e-4; a wrong RoPE row order or a missed norm moves logits by whole units.
LOGIT_ATOL = 2e-3

# The kvgate paths compared (fixtures): dequantized to float32, and the default (quantized
# weights, float32 activations).
PATHS = ["kvgate_smollm2", "kvgate_smollm2_quantized"]

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "Once upon a time, a small robot",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a primary colour."},
    ],
    [{"role": "user", "content": "Translate 'merci' into English."}],
]


def _prompts(hf_tokenizer: Any) -> dict[str, list[int]]:
    prompts = {
        f"plain-{i}": list(hf_tokenizer.encode(text, add_special_tokens=False))
        for i, text in enumerate(PLAIN)
    }
    for i, messages in enumerate(CHATS):
        text = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        prompts[f"chat-{i}"] = list(hf_tokenizer.encode(text, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="module")
def prompts(hf_tokenizer: Any) -> dict[str, list[int]]:
    return _prompts(hf_tokenizer)


@pytest.fixture(scope="module")
def hf_greedy(hf_model: Any, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    out = {}
    with torch.no_grad():
        for rid, ids in prompts.items():
            generated = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=EOS,
            )
            out[rid] = generated[0, len(ids) :].tolist()
    return out


def _run(
    loaded: LoadedModel, prompts: dict[str, list[int]], cfg: DriverConfig, stagger: bool
) -> dict[str, list[int]]:
    executor = Executor(
        loaded,
        num_blocks=96,
        block_size=16,
        host_snapshot_blocks=48,
        batch_invariant=loaded.model.batch_invariant,
    )
    requests = [
        (
            wire.NewRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=wire.SamplingParams(max_tokens=MAX_TOKENS),
            ),
            1 + (i % 4 if stagger else 0),
        )
        for i, (rid, ids) in enumerate(prompts.items())
    ]
    outputs = Driver(executor, requests, cfg).run()
    return {rid: tokens for rid, (tokens, _) in outputs.items()}


def test_the_reference_continuations_are_the_known_ones(
    hf_greedy: dict[str, list[int]], hf_tokenizer: Any
) -> None:
    """Guards the reference itself: a broken reference would make every comparison vacuous."""
    assert hf_tokenizer.decode(hf_greedy["plain-0"]).startswith(" Paris")
    assert "Paris" in hf_tokenizer.decode(hf_greedy["chat-0"])


@pytest.mark.parametrize(
    ("mode", "cfg", "stagger"),
    [
        ("batched", DriverConfig(chunk_size=4096, mixed=True), False),
        ("chunked", DriverConfig(chunk_size=7, mixed=True, shuffle_seed=3), True),
        (
            "preempted",
            DriverConfig(
                chunk_size=11,
                swap_after={"plain-0": 3, "chat-0": 2, "chat-2": 5},
                recompute_after={"plain-1": 4, "chat-1": 1, "plain-4": 3},
                shuffle_seed=5,
            ),
            True,
        ),
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_greedy_ids_equal_transformers(
    request: pytest.FixtureRequest,
    path: str,
    prompts: dict[str, list[int]],
    hf_greedy: dict[str, list[int]],
    mode: str,
    cfg: DriverConfig,
    stagger: bool,
) -> None:
    assert len(prompts) >= 8
    loaded = request.getfixturevalue(path)
    assert _run(loaded, prompts, cfg, stagger) == hf_greedy, mode


@pytest.mark.parametrize("path", PATHS)
def test_prefill_and_decode_logits_match_transformers(
    request: pytest.FixtureRequest,
    path: str,
    hf_model: Any,
    prompts: dict[str, list[int]],
    hf_greedy: dict[str, list[int]],
) -> None:
    loaded = request.getfixturevalue(path)
    for rid in ("plain-0", "chat-1", "plain-3"):
        prompt = prompts[rid]
        sequence = prompt + hf_greedy[rid]
        with torch.no_grad():
            expected = hf_model(torch.tensor([sequence])).logits[0, len(prompt) - 1 :].float()
        actual = reference_logits(loaded.model, sequence, len(prompt))
        assert actual.shape == expected.shape
        difference = float((actual - expected).abs().max())
        assert difference < LOGIT_ATOL, (rid, difference)


def test_conversion_equals_transformers_reading_of_the_gguf_file(
    smollm2_dir: Path, hf_reference_dir: Path
) -> None:
    """Dequantization and the RoPE row order, tensor by tensor, bit for bit."""
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    theirs = load_file(str(hf_reference_dir / "model.safetensors"))
    theirs.pop("lm_head.weight", None)  # tied: transformers may store the copy
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_the_gguf_file_loads_directly_with_the_converted_weights(
    smollm2_gguf: Path, kvgate_smollm2: LoadedModel
) -> None:
    direct = load_model(smollm2_gguf, dtype=DType.FLOAT32)  # dequantized, as converted
    assert direct.model.config == kvgate_smollm2.model.config
    for ours, converted in zip(
        direct.model.weights.layers, kvgate_smollm2.model.weights.layers, strict=True
    ):
        assert torch.equal(ours.qkv_proj, converted.qkv_proj)
        assert torch.equal(ours.mlp.down_proj, converted.mlp.down_proj)
    assert torch.equal(direct.model.weights.embed, kvgate_smollm2.model.weights.embed)
    assert direct.tokenizer is not None
    assert direct.tokenizer.encode("Hello, world 42!") == [19556, 28, 905, 216, 36, 34, 17]


def test_transformers_loads_the_converted_directory(
    smollm2_dir: Path, prompts: dict[str, list[int]], hf_greedy: dict[str, list[int]]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert list(tokenizer.encode(text, add_special_tokens=False)) == prompts["chat-0"]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompts["chat-0"]]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    assert generated[0, len(prompts["chat-0"]) :].tolist() == hf_greedy["chat-0"]


def test_logprobs_match_transformers_log_softmax(
    kvgate_smollm2: LoadedModel,
    hf_model: Any,
    prompts: dict[str, list[int]],
    hf_greedy: dict[str, list[int]],
) -> None:
    prompt = prompts["chat-0"]
    request = wire.NewRequest(
        request_id="lp",
        prompt_token_ids=prompt,
        sampling=wire.SamplingParams(max_tokens=4, logprobs=5),
    )
    executor = Executor(kvgate_smollm2, num_blocks=16, block_size=16)
    driver = Driver(executor, [(request, 1)], DriverConfig(chunk_size=16))
    driver.run()
    tokens = [t for result in driver.results for t in result.sampled_tokens()]
    assert [t.token_id for t in tokens] == hf_greedy["chat-0"][:4]
    sequence = prompt + [t.token_id for t in tokens]
    with torch.no_grad():
        logits = hf_model(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for token, row in zip(tokens, expected, strict=True):
        assert token.logprob is not None and token.top_logprobs is not None
        assert abs(token.logprob - float(row[token.token_id])) < LOGIT_ATOL
        top = torch.topk(row, 5)
        assert [t.token_id for t in token.top_logprobs] == top.indices.tolist()
        for ours, theirs in zip(token.top_logprobs, top.values.tolist(), strict=True):
            assert abs(ours.logprob - theirs) < LOGIT_ATOL
        assert token.top_logprobs[0].token_id == token.token_id  # greedy: the top one
