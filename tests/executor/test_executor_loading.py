"""Loading Hugging Face-format directories: shards, tokenizers, tied embeddings, the Llama / Qwen2
/ Mistral / Ouro variants, RoPE scaling, dtypes — and a clear error for every bad checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.executor.config import CheckpointError, RopeScaling, RopeType
from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.executor.model import LayerAttention
from kvgate.executor.reference import dense_causal_attention, reference_generate
from kvgate.executor.rope import inverse_frequencies
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType, ModelFamily
from tests.executor.hf_forward import hf_last_logits

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(str(file))
    return out


def _pipeline_last_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    model = load_model(model_dir).model
    positions = torch.arange(len(token_ids))

    def attention(
        layer: int, settings: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return dense_causal_attention(q, k, v, positions, settings.softmax_scale)

    hidden = model.embed(torch.tensor(token_ids))
    for _ in range(model.num_loops):
        hidden = model.core_pass(hidden, positions, len(token_ids) - 1, attention)
    return model.logits(hidden[-1:])[0]


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(**SMALL, model_type="llama"),
        TinyModelSpec(**SMALL, model_type="qwen2", seed=3),
        TinyModelSpec(**SMALL, model_type="mistral", tie_word_embeddings=True, seed=4),
        TinyModelSpec(**SMALL, family=ModelFamily.LOOPED, num_loops=3, seed=5),
    ],
    ids=["llama", "qwen2-bias", "mistral-tied", "ouro-looped"],
)
def test_model_math_matches_the_hf_equations(tmp_path: Path, spec: TinyModelSpec) -> None:
    model_dir = make_tiny_model(tmp_path / "m", spec)
    config = json.loads((model_dir / "config.json").read_text())
    tokens = [5, 17, 3, 42, 8, 1, 30]
    expected = hf_last_logits(_tensors(model_dir), config, tokens)
    got = _pipeline_last_logits(model_dir, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_qwen2_loads_qkv_biases(tmp_path: Path) -> None:
    loaded = load_model(make_tiny_model(tmp_path / "q", TinyModelSpec(**SMALL, model_type="qwen2")))
    assert loaded.model.config.qkv_bias and not loaded.model.config.o_bias
    assert all(layer.qkv_bias is not None for layer in loaded.model.weights.layers)


def test_sharded_checkpoint_equals_single_file(tmp_path: Path) -> None:
    single = load_model(make_tiny_model(tmp_path / "one", TinyModelSpec(**SMALL, seed=9)))
    sharded_dir = make_tiny_model(tmp_path / "three", TinyModelSpec(**SMALL, seed=9, num_shards=3))
    assert len(list(sharded_dir.glob("model-*-of-00003.safetensors"))) == 3
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    sharded = load_model(sharded_dir)
    request = wire.NewRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    assert reference_generate(single.model, request) == reference_generate(sharded.model, request)
    assert torch.equal(single.model.weights.lm_head, sharded.model.weights.lm_head)


def test_tied_embeddings_share_the_head(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "t", TinyModelSpec(**SMALL, tie_word_embeddings=True))
    assert "lm_head.weight" not in _tensors(model_dir)
    weights = load_model(model_dir).model.weights
    assert weights.lm_head is weights.embed


def test_tied_checkpoint_that_also_stores_the_head_loads(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "t", TinyModelSpec(**SMALL, tie_word_embeddings=True))
    tensors = _tensors(model_dir)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(model_dir / "model.safetensors"))
    weights = load_model(model_dir).model.weights
    assert weights.lm_head is weights.embed


def test_tokenizer_is_loaded_and_reported(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tok", TinyModelSpec(vocab_size=272, hidden_size=32))
    loaded = load_model(model_dir)
    assert loaded.tokenizer is not None
    text = "héllo, wörld\n"
    ids = loaded.tokenizer.encode(text)
    assert ids == list(text.encode())  # byte-level: token id == byte value
    assert loaded.tokenizer.decode([*ids, 257]) == text  # <|eos|> is special, skipped
    info = Executor(loaded, num_blocks=8).info
    assert info.has_tokenizer and info.eos_token_id == 257


def test_model_without_tokenizer(llama_dir: Path) -> None:
    loaded = load_model(llama_dir)
    assert loaded.tokenizer is None
    assert not Executor(loaded, num_blocks=8).info.has_tokenizer


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_half_precision_weights_and_cache(llama_dir: Path, dtype: DType) -> None:
    executor = Executor(llama_dir, num_blocks=8, dtype=dtype)
    torch_dtype = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
    assert executor.model.weights.embed.dtype == torch_dtype
    assert executor.cache.keys.dtype == torch_dtype
    config = executor.model.config
    per_block = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 2
    assert executor.info.kv_bytes_per_block == per_block


def test_a_mistral_window_slides_every_layer_and_a_llama_one_caps(tmp_path: Path) -> None:
    """transformers' Mistral slides every layer; its Llama ignores the key, which kvgate serves
    by capping the context where the two agree."""
    for model_type, context, windows in (("mistral", 2048, [512, 512]), ("llama", 512, [None] * 2)):
        spec = TinyModelSpec(**SMALL, model_type=model_type)
        model_dir = make_tiny_model(tmp_path / model_type, spec)
        config = json.loads((model_dir / "config.json").read_text())
        config["sliding_window"] = 512
        (model_dir / "config.json").write_text(json.dumps(config))
        model = load_model(model_dir).model
        assert model.config.max_model_len == context
        assert [layer.attention.settings.sliding_window for layer in model.layers] == windows


def test_linear_rope_scaling_divides_every_frequency() -> None:
    plain = inverse_frequencies(16, 10000.0, RopeScaling())
    scaled = inverse_frequencies(16, 10000.0, RopeScaling(rope_type=RopeType.LINEAR, factor=4.0))
    torch.testing.assert_close(scaled, plain / 4.0)


def test_llama3_rope_scaling_keeps_high_and_scales_low_frequencies() -> None:
    scaling = RopeScaling(
        rope_type=RopeType.LLAMA3,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    plain = inverse_frequencies(32, 500000.0, RopeScaling())
    scaled = inverse_frequencies(32, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 64 / 4.0
    low = wavelen > 64 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_rope_scaling_from_config_changes_outputs(tmp_path: Path) -> None:
    spec = TinyModelSpec(**SMALL, seed=6)
    plain = load_model(make_tiny_model(tmp_path / "a", spec)).model
    scaled_spec = spec.model_copy(update={"rope_scaling": {"rope_type": "linear", "factor": 3.0}})
    scaled = load_model(make_tiny_model(tmp_path / "b", scaled_spec)).model
    assert scaled.config.rope_scaling.rope_type is RopeType.LINEAR
    request = wire.NewRequest(
        request_id="r",
        prompt_token_ids=list(range(1, 30)),
        sampling=wire.SamplingParams(max_tokens=8),
    )
    assert reference_generate(plain, request) != reference_generate(scaled, request)


# ------------------------------------------------------------------------ bad checkpoints


@pytest.fixture
def good_dir(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "good", TinyModelSpec(**SMALL))


def _rewrite(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(model_dir / "model.safetensors"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(good_dir: Path) -> None:
    tensors = _tensors(good_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    _rewrite(good_dir, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load_model(good_dir)


def test_wrong_shape_is_named(good_dir: Path) -> None:
    tensors = _tensors(good_dir)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    _rewrite(good_dir, tensors)
    with pytest.raises(
        CheckpointError,
        match=r"k_proj\.weight has shape \(32, 32\), config\.json implies \(16, 32\)",
    ):
        load_model(good_dir)


def test_unexpected_tensor_is_named(good_dir: Path) -> None:
    tensors = _tensors(good_dir)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(64, 32)  # a third layer
    _rewrite(good_dir, tensors)
    with pytest.raises(CheckpointError, match=r"does not describe: model\.layers\.2\.mlp"):
        load_model(good_dir)


def test_rotary_buffers_from_old_exporters_are_ignored(good_dir: Path) -> None:
    tensors = _tensors(good_dir)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    _rewrite(good_dir, tensors)
    load_model(good_dir)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "s", TinyModelSpec(**SMALL, num_shards=2))
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"00002\.safetensors, which is missing"):
        load_model(model_dir)


def test_index_pointing_at_the_wrong_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "s", TinyModelSpec(**SMALL, num_shards=2))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="which lacks it"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
        ({"rope_scaling": {"rope_type": "proportional"}}, "unsupported rope_scaling type"),
        ({"num_hidden_layers": None}, "config.json lacks num_hidden_layers"),
        ({"num_key_value_heads": 3}, "not a multiple of 3"),
        ({"model_type": "ouro"}, "lacks total_ut_steps"),
    ],
)
def test_bad_config_is_explained(good_dir: Path, changes: dict[str, object], message: str) -> None:
    _edit_config(good_dir, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_model(good_dir)


def test_missing_directory_config_and_weights(tmp_path: Path, good_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        load_model(empty)
    shutil.copy(good_dir / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match=r"holds no \*\.safetensors"):
        load_model(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(empty)


def test_tokenizer_larger_than_the_model(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tok", TinyModelSpec(vocab_size=272, hidden_size=32))
    _edit_config(model_dir, vocab_size=200)
    tensors = _tensors(model_dir)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:200]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:200]
    _rewrite(model_dir, tensors)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json has 258 tokens"):
        load_model(model_dir)


def test_make_tiny_model_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.cli import main

    target = tmp_path / "cli-model"
    code = main(
        ["make-tiny-model", str(target), "--family", "looped", "--loops", "2", "--shards", "2"]
    )
    assert code == 0
    assert "looped" in capsys.readouterr().out
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["total_ut_steps"] == 2
    loaded = load_model(target)
    assert loaded.model.num_loops == 2 and loaded.tokenizer is not None
    assert main(["make-tiny-model", str(tmp_path / "bad"), "--loops", "3"]) == 2
