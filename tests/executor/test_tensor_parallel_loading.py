"""Sharded loading: each rank's tensors, read from safetensors slices or cut from GGUF tensors,
tile the whole checkpoint exactly (split tensors concatenate back to the file's tensor, padded
vocabulary rows are zero, replicated ones are whole on every rank)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvgate.executor.config import ModelConfig, load_config
from kvgate.executor.gguf_checkpoint import read_gguf_checkpoint
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.executor.weights import read_checkpoint
from tests.real_model.gguf_writer import write_llama_gguf

WORLD = 2
Reader = Callable[[ShardPlan | None], dict[str, torch.Tensor]]


def _check_tiling(config: ModelConfig, read: Reader) -> None:
    whole = read(None)
    ranks = [read(ShardPlan(rank, WORLD)) for rank in range(WORLD)]
    for name, full in whole.items():
        parts = [r[name] for r in ranks]
        part = ShardPlan(0, WORLD).slice_of(name, config)
        kv = name.endswith(("k_proj.weight", "v_proj.weight"))
        if part is None or (kv and config.num_kv_heads < WORLD):
            assert all(torch.equal(p, full) for p in parts), name  # replicated
            continue
        # Each rank holds only its share (vocabulary shards rounded up).
        assert parts[0].shape[part.dim] == -(-full.shape[part.dim] // WORLD), name
        joined = torch.cat(parts, dim=part.dim)
        rows = full.shape[0]
        assert torch.equal(joined[:rows] if part.dim == 0 else joined, full), name
        assert not joined[rows:].any(), name  # vocabulary padding is zero


@pytest.mark.parametrize("kv_heads", [1, 2])  # replicated / split over two ranks
def test_safetensors_slices_tile_the_checkpoint(tmp_path: Path, kv_heads: int) -> None:
    spec = TinyModelSpec(vocab_size=127, num_kv_heads=kv_heads, num_shards=2, seed=7)
    model_dir = make_tiny_model(tmp_path, spec)
    config = load_config(model_dir)

    def read(shard: ShardPlan | None) -> dict[str, torch.Tensor]:
        return read_checkpoint(model_dir, config, torch.float32, torch.device("cpu"), shard)

    _check_tiling(config, read)


def test_gguf_tensors_cut_per_rank_tile_the_file(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=96, vocab_size=273, seed=3)
    path = write_llama_gguf(tmp_path / "tiny.gguf", make_tiny_model(tmp_path / "hf", spec))

    def read(shard: ShardPlan | None) -> dict[str, torch.Tensor]:
        return read_gguf_checkpoint(path, shard=shard).tensors

    _check_tiling(read_gguf_checkpoint(path).config, read)


def test_gguf_heads_are_checked_before_any_tensor(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=96, vocab_size=272, seed=3)
    path = write_llama_gguf(tmp_path / "tiny.gguf", make_tiny_model(tmp_path / "hf", spec))
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by"):
        read_gguf_checkpoint(path, shard=ShardPlan(0, 3))
