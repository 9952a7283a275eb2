"""SmolLM2-135M-Instruct served as stored (Q4_1 matrices, a Q8_0 embedding), int8 activations.

The golden tests (test_golden.py) compare the dequantized path and the default quantized one
(float32 activations) with transformers, greedy ids equal; here the int8 activations
(``--activations int8``) are compared with the dequantized path:

- the weights stay in their blocks (memory within ``MEMORY_BOUND`` of the file) and the blocks
  dequantize to the float32 path's tensors bit for bit, so the two paths differ only in the
  int8 activations of the quantized products (as llama.cpp's CPU backend computes them);
- logits stay within ``LOGIT_REL_BOUND`` (relative norm) and ``LOGIT_ATOL`` of the float32
  path's, and the top token at a prompt's last position is the float32 path's, or one the
  float32 path scores within ``TIE_MARGIN`` of its top (a near tie the int8 rounding may flip);
- greedy ids are the same whether prompts run batched, chunked or preempted in the
  batch-invariant mode, with either activations (the quantized product of a row never depends
  on its batch there; the mode fixes attention's order), and the known answer is still the
  answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.quantized import QuantizedWeight, weight_nbytes
from kvgate.executor.reference import reference_logits
from kvgate.protocol.enums import DType, QuantActivations
from tests.executor.driver import DriverConfig
from tests.real_model.test_golden import _prompts, _run

# Measured on four prompts (3 positions each): relative norm 0.033-0.057, max |diff| 0.80-1.23
# on logits of size ~30 (an AVX2 machine). The top token at the last prompt position agreed on 7
# of the 8 golden prompts; chat-0 ("What is the capital of France?") is a near tie in float32
# (token 504 at 25.325, token 60 "L" at 25.243) that the int8 path resolves the other way (60 at
# 25.04, 504 at 24.88), so its greedy answer begins "L'Étoile" rather than "Paris".
# The int8 activations' error depends on the machine's float rounding before each quantization
# (a value on a rounding edge moves a whole step): on an AVX-512 AMD machine plain-0, plain-3 and
# chat-0 measured 0.046 / 0.056 / 0.092 with the CPU kernels and 0.056 / 0.030 / 0.114 on the
# torch path (KVGATE_CPU_KERNELS=torch). A block's weights in the wrong order measure 1.5.
LOGIT_REL_BOUND = 0.15
LOGIT_ATOL = 2.0
TIE_MARGIN = 0.25
MEMORY_BOUND = 1.15


@pytest.fixture(scope="module")
def quantized(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf, activations=QuantActivations.INT8)


@pytest.fixture(scope="module")
def dequantized(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf, dtype=DType.FLOAT32)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer: Any) -> dict[str, list[int]]:
    return _prompts(hf_tokenizer)


def _all_weights(loaded: LoadedModel) -> list[Any]:
    weights = loaded.model.weights
    layers = [t for layer in weights.layers for t in layer.tensors()]
    # The LM head is the embedding itself (tied): counted once.
    assert weights.lm_head is weights.embed
    return [weights.embed, weights.norm, *layers]


def test_weights_stay_in_their_blocks(quantized: LoadedModel, smollm2_gguf: Path) -> None:
    weights = _all_weights(quantized)
    total = sum(weight_nbytes(w) for w in weights)
    assert total <= MEMORY_BOUND * smollm2_gguf.stat().st_size
    layer = quantized.model.weights.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedWeight)
    assert layer.qkv_proj.formats == ("Q4_1",)
    assert isinstance(quantized.model.weights.embed, QuantizedWeight)
    assert quantized.model.weights.embed.formats == ("Q8_0",)


def test_blocks_dequantize_to_the_float32_path(
    quantized: LoadedModel, dequantized: LoadedModel
) -> None:
    """The RoPE row order and the q/k/v stacking moved whole rows of blocks, nothing else."""
    for ours, theirs in zip(
        quantized.model.weights.layers, dequantized.model.weights.layers, strict=True
    ):
        for q, f in zip(ours.tensors(), theirs.tensors(), strict=True):
            values = q.dequantize() if isinstance(q, QuantizedWeight) else q
            assert torch.equal(values, f)
    embed = quantized.model.weights.embed
    assert isinstance(embed, QuantizedWeight)
    assert torch.equal(embed.dequantize(), dequantized.model.weights.embed)


def test_logits_are_close_to_the_float32_path(
    quantized: LoadedModel, dequantized: LoadedModel, prompts: dict[str, list[int]]
) -> None:
    for rid in ("plain-0", "plain-3", "chat-0"):
        prompt = prompts[rid]
        sequence = [*prompt, 1, 2]
        ours = reference_logits(quantized.model, sequence, len(prompt))
        theirs = reference_logits(dequantized.model, sequence, len(prompt))
        relative = float((ours - theirs).norm() / theirs.norm())
        assert relative < LOGIT_REL_BOUND, (rid, relative)
        assert float((ours - theirs).abs().max()) < LOGIT_ATOL, rid
        # The float32 path's score of our top token: its top, or within a near tie of it.
        gap = float(theirs[0].max() - theirs[0, int(ours[0].argmax())])
        assert gap <= TIE_MARGIN, (rid, gap)


@pytest.mark.parametrize("activations", list(QuantActivations))
def test_greedy_ids_do_not_depend_on_the_schedule(
    smollm2_gguf: Path,
    prompts: dict[str, list[int]],
    hf_tokenizer: Any,
    activations: QuantActivations,
) -> None:
    """In the batch-invariant mode (--batch-invariant): the quantized products never depend on
    a row's batch, and the mode makes attention sum a row's prefill tokens in one order however
    the prompt is chunked (without it, chunking changes attention's summation order, and a near
    tie can flip: plain-4 did on an AVX-512 machine and not on an AVX2 one)."""
    invariant = load_model(smollm2_gguf, batch_invariant=True, activations=activations)
    batched = _run(invariant, prompts, DriverConfig(chunk_size=4096, mixed=True), False)
    chunked = _run(invariant, prompts, DriverConfig(chunk_size=7, mixed=True, shuffle_seed=3), True)
    preempted = _run(
        invariant,
        prompts,
        DriverConfig(
            chunk_size=11,
            swap_after={"plain-0": 3, "chat-0": 2},
            recompute_after={"plain-1": 4, "chat-1": 1},
            shuffle_seed=5,
        ),
        True,
    )
    assert batched == chunked == preempted
    assert hf_tokenizer.decode(batched["plain-0"]).startswith(" Paris")
    if activations is QuantActivations.FLOAT32:  # the dequantized model's answer, near tie kept
        assert "Paris" in hf_tokenizer.decode(batched["chat-0"])
