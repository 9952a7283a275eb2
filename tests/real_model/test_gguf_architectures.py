"""GGUF files of every architecture kvgate reads, written as llama.cpp's converter writes them
from tiny random checkpoints that transformers 5 wrote, read back equal to those checkpoints.

For each family: the same weights as a transformers checkpoint (``save_pretrained``) and as a
GGUF file (:mod:`tests.real_model.gguf_writer`); ``kvgate convert`` must give back every tensor
bit for bit (float32, float16 storage), a config that means what transformers' config means,
and a directory transformers runs to its own greedy ids; the executor must serve the file with
those ids once it runs the model type (until then those tests skip, naming why).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvgate.executor.config import CheckpointError, parse_config
from kvgate.executor.config_keys import MODEL_TYPES
from kvgate.executor.gguf_checkpoint import convert
from kvgate.executor.gguf_file import GgufFile
from tests.real_model.gguf_writer import hf_tensors, write_gguf

Q = gguf.GGMLQuantizationType
_SHAPE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}
# The llama3 ramp acts on every wavelength above 16 positions (as in test_config_layouts).
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Longer than Gemma's window of 8 (with the continuation), and one of two tokens.
_PROMPTS = [
    [256, 200, 11, 9, 310, 45, 46, 47, 180, 6, 222, 31, 90, 14, 3, 101, 57, 12, 19, 200, 44],
    [256, 5],
]
_MAX_TOKENS = 10


def _transformers_config(family: str) -> Any:
    import transformers as tf

    # Gemma's query scale is not in a GGUF file: llama.cpp uses head_dim below the 27B size.
    gemma = {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16}
    configs = {
        "llama": lambda: tf.LlamaConfig(**_SHAPE),
        "llama-bias": lambda: tf.LlamaConfig(**_SHAPE, attention_bias=True),
        "llama3-scaled": lambda: tf.LlamaConfig(**_SHAPE, rope_parameters=dict(_LLAMA3)),
        "mistral": lambda: tf.MistralConfig(**_SHAPE, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(
            **_SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
        "qwen3": lambda: tf.Qwen3Config(**_SHAPE, head_dim=24),
        "gemma2": lambda: tf.Gemma2Config(**_SHAPE, **gemma),
        # 7 layers: five sliding, one global (the sixth), one sliding.
        "gemma3": lambda: tf.Gemma3TextConfig(**{**_SHAPE, "num_hidden_layers": 7}, **gemma),
        "phi3": lambda: tf.Phi3Config(**_SHAPE, original_max_position_embeddings=256),
        # Every prompt and its greedy continuation (21 + 10 tokens) within the original context:
        # past it kvgate rotates each position by its own factors while transformers rotates a
        # whole forward by its length's, so greedy ids may part there (docs/models.md).
        "phi3-longrope": lambda: tf.Phi3Config(
            **_SHAPE,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                # float32 values: a GGUF file stores the lists as float32 tensors
                "long_factor": [1.0 + 0.75 * i for i in range(8)],
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
            },
        ),
    }
    return configs[family]()


FAMILIES = [
    "llama",
    "llama-bias",
    "llama3-scaled",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3-longrope",
]


@dataclass(frozen=True)
class Written:
    model_dir: Path  # as transformers 5 wrote it
    greedy_ids: list[list[int]]  # transformers' greedy continuation of each prompt
    model_type: str


def _redraw_wide(model: Any, seed: int) -> None:
    """Weights with a wide spread, norms around their neutral value (Gemma's offsets around 0):
    greedy paths that diverge at once when the math is off."""
    generator = torch.Generator().manual_seed(seed)
    offset_norms = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_((0.0 if offset_norms else 1.0) + 0.1 * noise)
            else:
                parameter.copy_(0.25 * noise)


def greedy(model: Any, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(_MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _write(family: str, directory: Path) -> Written:
    from transformers import AutoModelForCausalLM

    config = _transformers_config(family)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _redraw_wide(model, seed=sum(map(ord, family)))
    model.save_pretrained(directory, safe_serialization=True)
    return Written(directory, [greedy(model, p) for p in _PROMPTS], config.model_type)


class _Checkpoints(dict[str, Written]):
    """Each family's checkpoint, written on first use (a selection of tests builds only its own)."""

    def __init__(self, factory: pytest.TempPathFactory):
        super().__init__()
        self._factory = factory

    def __missing__(self, family: str) -> Written:
        self[family] = _write(family, self._factory.mktemp(family))
        return self[family]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    return _Checkpoints(tmp_path_factory)


def _converted(written: Written, tmp_path: Path, kind: Q = Q.F32) -> Path:
    path = write_gguf(tmp_path / "model.gguf", written.model_dir, kind=kind)
    return convert(path, tmp_path / "converted").out_dir


def _expected(name: str, values: np.ndarray, model_type: str, kind: Q) -> np.ndarray:
    """What the GGUF file can give back: float16-rounded matrices in F16 files; Gemma's norms
    through their ``w + 1`` float32 form."""
    if kind == Q.F16 and values.ndim == 2:
        values = values.astype(np.float16).astype(np.float32)
    if model_type.startswith("gemma") and name.endswith("norm.weight"):
        values = (values + np.float32(1.0)) - np.float32(1.0)
    return values


@pytest.mark.parametrize(
    ("family", "kind"),
    [(family, Q.F32) for family in FAMILIES]
    + [(family, Q.F16) for family in ("llama", "gemma3", "phi3")],
)
def test_every_tensor_reads_back_bit_for_bit(
    written: dict[str, Written], family: str, kind: Q, tmp_path: Path
) -> None:
    source = written[family]
    ours = load_file(str(_converted(source, tmp_path, kind) / "model.safetensors"))
    theirs = {n: t.float().numpy() for n, t in hf_tensors(source.model_dir).items()}
    if json.loads((source.model_dir / "config.json").read_text())["tie_word_embeddings"]:
        theirs.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        expected = _expected(name, values, source.model_type, kind)
        assert np.array_equal(ours[name].numpy(), expected), name


# Keys of transformers' config.json that are not the model's math (or that kvgate writes in the
# other spelling): the GGUF file has no reason to carry them.
_NOT_MATH = {"transformers_version", "dtype", "torch_dtype", "architectures"}


def _same_value(ours: Any, theirs: Any) -> bool:
    """Equal, with lists of floats compared as the float32 values a GGUF tensor holds."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return all(k in theirs and _same_value(v, theirs[k]) for k, v in ours.items())
    if isinstance(ours, list) and ours and isinstance(ours[0], float):
        return bool(np.array_equal(np.float32(ours), np.float32(theirs)))
    return bool(ours == theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_says_what_transformers_config_says(
    written: dict[str, Written], family: str, tmp_path: Path
) -> None:
    """Every key the file's config states has transformers' value; where kvgate's config parser
    runs the model type, both configs parse to the same ModelConfig."""
    source = written[family]
    theirs = json.loads((source.model_dir / "config.json").read_text())
    ours = GgufFile(write_gguf(tmp_path / "model.gguf", source.model_dir)).hf_config()
    compared = dict(ours)
    if source.model_type == "mistral":  # llama.cpp converts Mistral as llama
        stated = (compared.pop("model_type"), compared.pop("architectures"))
        assert stated == ("llama", ["LlamaForCausalLM"])
        # Llama's bias switches, off: Mistral's config has none to state.
        assert (compared.pop("attention_bias"), compared.pop("mlp_bias")) == (False, False)
    else:
        assert compared["architectures"] == theirs["architectures"]
    differing = {
        key: (value, theirs.get(key, "<absent>"))
        for key, value in compared.items()
        if key not in _NOT_MATH and not _same_value(value, theirs.get(key))
    }
    assert not differing
    try:
        expected = parse_config(theirs)
    except CheckpointError as refusal:
        with pytest.raises(CheckpointError):
            parse_config(ours)
        pytest.skip(f"kvgate's executor does not run {source.model_type} yet: {refusal}")
    # The model type is a name (llama for a Mistral file); the family and the math must agree.
    same = {"torch_dtype": None, "model_type": expected.model_type}
    assert parse_config(ours).model_copy(update=same) == expected.model_copy(update=same)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_runs_the_converted_directory_to_its_greedy_ids(
    written: dict[str, Written], family: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    converted = _converted(written[family], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(converted), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert [greedy(model, p) for p in _PROMPTS] == written[family].greedy_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_the_executor_serves_the_file_with_transformers_greedy_ids(
    written: dict[str, Written], family: str, tmp_path: Path
) -> None:
    """Every prompt at once through the paged executor from the .gguf file, in chunks of 5."""
    from kvgate.executor.executor import Executor
    from kvgate.protocol import step as wire
    from tests.executor.driver import Driver, DriverConfig

    source = written[family]
    if source.model_type not in MODEL_TYPES:
        pytest.skip(f"kvgate's executor does not run model_type {source.model_type} yet")
    path = write_gguf(tmp_path / "model.gguf", source.model_dir, kind=Q.F32)
    sampling = wire.SamplingParams(max_tokens=_MAX_TOKENS, ignore_eos=True)
    requests = [
        (wire.NewRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling), i)
        for i, p in enumerate(_PROMPTS)
    ]
    executor = Executor(path, num_blocks=64, block_size=4)
    outputs = Driver(executor, requests, DriverConfig(chunk_size=5)).run()
    assert [outputs[f"r{i}"][0] for i in range(len(_PROMPTS))] == source.greedy_ids


@pytest.mark.parametrize(
    ("family", "without"),
    [("llama3-scaled", "rope_freqs.weight"), ("phi3-longrope", "rope_factors_long.weight")],
)
def test_the_rope_tables_matter(
    written: dict[str, Written], family: str, without: str, tmp_path: Path
) -> None:
    """The greedy test above can fail: the same file read without its RoPE table is another
    model to transformers (and a long-RoPE file without one of its tables is refused)."""
    from transformers import AutoModelForCausalLM

    source = written[family]
    path = write_gguf(tmp_path / "model.gguf", source.model_dir)
    stripped = _without_tensor(path, without, tmp_path / "stripped.gguf")
    if family.startswith("phi3"):
        with pytest.raises(CheckpointError, match=r"LongRoPE needs rope_factors_long\.weight"):
            GgufFile(stripped).hf_config()
        return
    out = convert(stripped, tmp_path / "converted").out_dir
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = [greedy(model, p) for p in _PROMPTS]
    assert all(o != t for o, t in zip(ids, source.greedy_ids, strict=True))


def _without_tensor(path: Path, name: str, target: Path) -> Path:
    """A copy of a GGUF file less one tensor (metadata kept)."""
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(target), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), value_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), value_type)
    for tensor in reader.tensors:
        if tensor.name != name:
            shape = tuple(int(d) for d in reversed(tensor.shape))
            writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
