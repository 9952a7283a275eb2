"""Phi-3 against checkpoints transformers 5 wrote: fused ``qkv_proj`` and ``gate_up_proj``
(read as one matmul each, cut into every rank's q/k/v and gate/up rows under tensor
parallelism), every layer sliding when ``sliding_window`` is set, and LongRoPE.

LongRoPE: transformers rotates a call with the long factors once its last position reaches
``original_max_position_embeddings``; kvgate rotates each position by its own place
(kvgate/executor/rope.py). The two agree for transformers' forward with a KV cache, one
position per call, which is what the reference here runs; ``generate()`` agrees with it until a
sequence passes the original context, where transformers re-runs the whole sequence with the
long factors (test_generate_agrees_within_the_original_context pins both facts).
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvgate.executor.config import parse_config
from kvgate.executor.rope_config import RopeType
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.executor.weights import read_checkpoint
from tests.executor.family_cases import WrittenFamilies
from tests.executor.hf_checkpoints import (
    config_of,
    full_forward_greedy,
    generate_greedy,
    kvgate_greedy,
)

GROUP = ["phi3", "phi3-longrope"]


def test_the_longrope_config_is_read_as_written(written: WrittenFamilies) -> None:
    config = parse_config(config_of(written["phi3-longrope"].model_dir))
    scaling = config.rope_scaling
    assert scaling.rope_type is RopeType.LONGROPE
    assert scaling.original_max_position_embeddings == 16 and scaling.factor == 64 / 16
    assert scaling.short_factor is not None and scaling.short_factor[3] == 1.6
    assert config.max_model_len == 64


def test_each_rank_reads_its_own_rows_of_the_fused_tensors(written: WrittenFamilies) -> None:
    """Two ranks: rank r's qkv_proj is its q heads, then its k and v heads; its gate_up_proj its
    gate columns, then its up columns (the one-process tensor cut the same way)."""
    model_dir = written["phi3"].model_dir
    config = parse_config(config_of(model_dir))
    whole = read_checkpoint(model_dir, config, torch.float32, torch.device("cpu"))
    qkv, gate_up = (
        whole["model.layers.1.self_attn.qkv_proj.weight"],
        whole["model.layers.1.mlp.gate_up_proj.weight"],
    )
    q, k, v = qkv.split([64, 32, 32])  # 4 query heads and 2 KV heads of 16
    gate, up = gate_up.chunk(2)
    for rank in range(2):
        part = read_checkpoint(
            model_dir, config, torch.float32, torch.device("cpu"), ShardPlan(rank, 2)
        )
        rows = slice(32 * rank, 32 * (rank + 1))
        heads = slice(16 * rank, 16 * (rank + 1))
        expected = torch.cat([q[rows], k[heads], v[heads]])
        assert torch.equal(part["model.layers.1.self_attn.qkv_proj.weight"], expected)
        columns = slice(64 * rank, 64 * (rank + 1))
        expected = torch.cat([gate[columns], up[columns]])
        assert torch.equal(part["model.layers.1.mlp.gate_up_proj.weight"], expected)
    with pytest.raises(ValueError, match="fused"):
        ShardPlan(0, 2).slice_of("model.layers.1.self_attn.qkv_proj.weight", config)


def test_the_load_says_where_kvgate_departs_from_transformers(
    written: WrittenFamilies, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvgate.executor.config"):
        parse_config(config_of(written["phi3-longrope"].model_dir))
        parse_config(config_of(written["phi3"].model_dir))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = warnings  # the LongRoPE model only
    assert "positions from 16 on rotate with the long factors" in warning
    assert "window 12 on 3 of 3 layers, context 256" in caplog.text


def test_generate_agrees_within_the_original_context(written: WrittenFamilies) -> None:
    """Short sequences: transformers' generate() gives kvgate's ids. Past the original context
    it re-rotates the whole sequence (its full-forward ids); kvgate keeps each key's rotation."""
    checkpoint = written["phi3-longrope"]
    model, prompt = checkpoint.model, checkpoint.prompts[0]  # 12 tokens
    within = 16 - len(prompt)  # the last output's position is 15
    ours = kvgate_greedy(checkpoint.model_dir, [prompt], max_tokens=within)[0]
    assert generate_greedy(model, prompt, within) == ours == checkpoint.greedy_ids[0][:within]
    assert generate_greedy(model, prompt) == full_forward_greedy(model, prompt)
    assert generate_greedy(model, prompt) != checkpoint.greedy_ids[0]
