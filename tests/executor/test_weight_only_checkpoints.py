"""AWQ, GPTQ and FP8 safetensors checkpoints, as those tools write them, through the real executor.

Each case quantizes a tiny transformers Llama here, with this file's own quantizer and packer
(independent of kvgate's reader): integers and scales per group, packed as AutoAWQ (GEMM layout,
nibble order 0 2 4 6 1 3 5 7) and AutoGPTQ (v1 zero points, act-order ``g_idx``) pack them, or
FP8 e4m3 with per-row or per-tensor scales as AutoFP8 writes them. transformers then runs the
model with the weights those integers and scales stand for, and the executor, reading the
packed file, must give its greedy ids and log-probabilities. Configurations kvgate does not read
are refused by name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvgate.executor.config import CheckpointError, load_config
from kvgate.executor.loader import load_model
from kvgate.executor.quantized import PackedSegment, QuantizedWeight, weight_nbytes
from kvgate.executor.weights import read_checkpoint, read_checkpoint_packed
from tests.executor.family_checks import assert_logprobs_close
from tests.executor.hf_checkpoints import (
    PROMPTS,
    SHAPE,
    Written,
    full_forward_greedy,
    kvgate_greedy,
    redraw_wide,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
# AutoAWQ packs the eight output columns 8c..8c+7 so that nibble p holds column 8c + ORDER[p].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-wide integers ``[R, C]`` -> int32 ``[R, C * bits / 32]``, the first
    value of each run of ``32 / bits`` in the lowest bits."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per).numpy().astype(np.uint64)
    packed = np.zeros(v.shape[:2], dtype=np.uint64)
    for i in range(per):
        packed |= v[..., i] << np.uint64(bits * i)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


def _asymmetric(w: torch.Tensor, groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """``w [N, K]`` to integers ``q [N, K]``, zero points ``[G, N]`` and float16 scales
    ``[G, N]``, one (scale, zero) per output row and group of inputs (``groups [K]``); also the
    float32 weight they stand for."""
    top = (1 << bits) - 1
    count = int(groups.max()) + 1
    q = torch.empty_like(w, dtype=torch.int64)
    zeros = torch.empty(count, w.shape[0], dtype=torch.int64)
    scales = torch.empty(count, w.shape[0], dtype=torch.float16)
    meant = torch.empty_like(w)
    for g in range(count):
        cols = groups == g
        part = w[:, cols]
        low, high = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-4).half()
        zero = torch.round(-low / scale.float()).clamp(0, top).long()
        ints = torch.clamp(torch.round(part / scale.float()[:, None]) + zero[:, None], 0, top)
        q[:, cols] = ints.long()
        zeros[g], scales[g] = zero, scale
        meant[:, cols] = (ints - zero[:, None]).float() * scale.float()[:, None]
    return q, zeros, scales, meant


def _awq(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    k = w.shape[1]
    q, zeros, scales, meant = _asymmetric(w, torch.arange(k) // GROUP, 4)
    order = list(AWQ_PACK_ORDER)

    def interleave(columns: torch.Tensor) -> torch.Tensor:  # [R, N] -> AutoAWQ's order
        return columns.reshape(columns.shape[0], -1, 8)[..., order].reshape(columns.shape[0], -1)

    stored = {
        "qweight": _pack(interleave(q.T.contiguous()), 4),
        "qzeros": _pack(interleave(zeros), 4),
        "scales": scales,
    }
    return stored, meant


def _gptq(w: torch.Tensor, bits: int, act_order: bool) -> tuple[dict[str, torch.Tensor], ...]:
    k = w.shape[1]
    rank = torch.arange(k)
    if act_order:  # groups follow a permutation of the inputs, as desc_act makes them
        rank = torch.argsort(torch.randperm(k, generator=torch.Generator().manual_seed(k)))
    g_idx = (rank // GROUP).to(torch.int32)
    q, zeros, scales, meant = _asymmetric(w, g_idx.long(), bits)
    mask = (1 << bits) - 1
    stored = {
        "qweight": _pack(q.contiguous(), bits).T.contiguous(),  # packed along K
        "qzeros": _pack((zeros - 1) & mask, bits),  # v1: the zero point minus one
        "scales": scales,
        "g_idx": g_idx,
    }
    return stored, meant  # type: ignore[return-value]


def _fp8(w: torch.Tensor, per_row: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    absmax = w.abs().amax(1) if per_row else w.abs().amax().reshape(1)
    scale = (absmax / 448.0).float()
    weight = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
    stored = {"weight": weight, "weight_scale": scale if per_row else scale.reshape(())}
    return stored, weight.float() * scale.reshape(-1, 1)


CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
         "zero_point": True, "modules_to_not_convert": None},
        _awq,
    ),
    "gptq-4bit-act-order": (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq"},
        lambda w: _gptq(w, 4, True),
    ),
    "gptq-8bit": (
        {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False, "sym": False},
        lambda w: _gptq(w, 8, False),
    ),
    "fp8-per-row": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        lambda w: _fp8(w, True),
    ),
    "fp8-per-tensor": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
        lambda w: _fp8(w, False),
    ),
}  # fmt: skip


def _write(name: str, directory: Path) -> Written:
    from transformers import AutoConfig, AutoModelForCausalLM

    quantization, quantize = CASES[name]
    config = AutoConfig.for_model("llama", **SHAPE)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    redraw_wide(model, seed=sum(map(ord, name)))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for layer in range(SHAPE["num_hidden_layers"]):
        for projection in PROJECTIONS:
            part = "self_attn" if projection[0] in "qkvo" else "mlp"
            module = f"model.layers.{layer}.{part}.{projection}"
            stored, meant = quantize(state.pop(f"{module}.weight"))
            state |= {f"{module}.{suffix}": t.contiguous() for suffix, t in stored.items()}
            with torch.no_grad():  # transformers runs what the stored numbers stand for
                model.get_submodule(module).weight.copy_(meant)
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    model.config.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    greedy = [full_forward_greedy(model, p) for p in PROMPTS]
    return Written(directory, PROMPTS, greedy, model, full_forward_greedy)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    root = tmp_path_factory.mktemp("weight-only")
    return {name: _write(name, root / name) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_ids_equal_transformers_on_the_weights_stored(
    written: dict[str, Written], name: str
) -> None:
    case = written[name]
    assert kvgate_greedy(case.model_dir) == case.greedy_ids


@pytest.mark.parametrize("name", ["awq", "gptq-4bit-act-order", "fp8-per-row"])
def test_logprobs_within_tolerance(written: dict[str, Written], name: str) -> None:
    assert_logprobs_close(written[name], written[name].model_dir)


@pytest.mark.parametrize("name", list(CASES))
def test_each_projection_is_the_weight_the_numbers_stand_for(
    written: dict[str, Written], name: str
) -> None:
    """Bit for bit what this file's quantizer meant (not the float weights the integers came
    from): a reader that misplaced a nibble, a zero point or a group would not match."""
    case = written[name]
    tensors = read_checkpoint(
        case.model_dir, load_config(case.model_dir), torch.float32, torch.device("cpu")
    )
    for module, reference in case.model.named_modules():
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            got = tensors[f"{module}.weight"]
            torch.testing.assert_close(got, reference.weight, rtol=0, atol=0, msg=module)


REFUSED = [
    ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    (CASES["awq"][0] | {"version": "gemv"}, "version='gemv'"),
    (CASES["awq"][0] | {"zero_point": False}, "zero_point=False"),
    (CASES["gptq-8bit"][0] | {"bits": 3}, "bits=3"),
    (CASES["gptq-8bit"][0] | {"checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
    (CASES["gptq-8bit"][0] | {"lm_head": True}, "lm_head=True"),
    (CASES["fp8-per-row"][0] | {"weight_block_size": [128, 128]}, "weight_block_size"),
    (CASES["fp8-per-row"][0] | {"activation_scheme": "static"}, "activation_scheme='static'"),
]


@pytest.mark.parametrize(("quantization", "message"), REFUSED)
def test_what_kvgate_does_not_read_is_refused_by_name(
    written: dict[str, Written], tmp_path: Path, quantization: dict[str, Any], message: str
) -> None:
    source = written["awq"].model_dir
    target = tmp_path / "m"
    target.mkdir()
    (target / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    raw = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(raw | {"quantization_config": quantization}))
    with pytest.raises(CheckpointError, match=message):
        load_model(target)


def test_a_group_index_past_the_scales_is_refused(
    written: dict[str, Written], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    source = written["gptq-8bit"].model_dir
    state = load_file(str(source / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    state[name] = torch.full_like(state[name], 99)
    target = tmp_path / "m"
    target.mkdir()
    save_file(state, str(target / "model.safetensors"))
    (target / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"up_proj\.g_idx names groups"):
        load_model(target)


def test_a_quantized_mixture_of_experts_is_refused() -> None:
    from transformers import AutoConfig

    from kvgate.executor.config import parse_config

    raw = AutoConfig.for_model("mixtral", **SHAPE, num_local_experts=4).to_dict()
    parse_config(dict(raw))  # the float model is served
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        parse_config(raw | {"quantization_config": CASES["awq"][0]})


@pytest.mark.parametrize(
    ("case", "name", "dtype"),
    [
        ("awq", "model.layers.0.self_attn.q_proj.qweight", torch.int64),
        ("gptq-8bit", "model.layers.2.mlp.down_proj.scales", torch.int32),
        ("fp8-per-row", "model.layers.1.self_attn.o_proj.weight", torch.float16),
    ],
)
def test_a_stored_tensor_of_another_dtype_is_refused(
    written: dict[str, Written], tmp_path: Path, case: str, name: str, dtype: torch.dtype
) -> None:
    from safetensors.torch import load_file

    source = written[case].model_dir
    state = load_file(str(source / "model.safetensors"))
    state[name] = state[name].to(dtype)
    target = tmp_path / "m"
    target.mkdir()
    save_file(state, str(target / "model.safetensors"))
    (target / "config.json").write_text((source / "config.json").read_text())
    shown = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} is {shown}"):
        load_model(target)


def test_a_tensor_parallel_read_is_refused(written: dict[str, Written]) -> None:
    """Each rank would need its slice of the packed columns and of the groups: not done, so
    refused before anything is read (the shard plan is never consulted)."""
    from typing import cast

    from kvgate.executor.tensor_parallel.shards import ShardPlan

    case = written["awq"]
    config = load_config(case.model_dir)
    with pytest.raises(CheckpointError, match="tensor-parallel loading"):
        read_checkpoint(
            case.model_dir, config, torch.float32, torch.device("cpu"), cast(ShardPlan, object())
        )


def test_the_packed_read_keeps_what_the_file_stores(written: dict[str, Written]) -> None:
    """Where Triton runs them, projections stay as stored: one PackedSegment each, which
    dequantizes to the float read bit for bit, and the weights take no more memory than the
    file (embeddings and norms are float there too)."""
    for name, case in written.items():
        config = load_config(case.model_dir)
        cpu = torch.device("cpu")
        packed = read_checkpoint_packed(case.model_dir, config, torch.float32, cpu)
        floats = read_checkpoint(case.model_dir, config, torch.float32, cpu)
        assert packed.keys() == floats.keys(), name
        for key, weight in packed.items():
            if key.rsplit(".", 2)[-2] in PROJECTIONS:
                assert isinstance(weight, QuantizedWeight), key
                (segment,) = weight.segments
                assert isinstance(segment, PackedSegment), key
                assert torch.equal(weight.dequantize(), floats[key]), f"{name}: {key}"
            else:
                assert isinstance(weight, torch.Tensor), key
        file_bytes = (case.model_dir / "model.safetensors").stat().st_size
        assert sum(weight_nbytes(w) for w in packed.values()) <= file_bytes, name


_INTERPRETED_RUN = """
import json, sys
from kvgate.executor.loader import load_model
from kvgate.executor.quantized import PackedSegment, QuantizedWeight
from tests.executor.hf_checkpoints import PROMPTS, kvgate_greedy

out = {}
for model_dir in sys.argv[1:]:
    loaded = load_model(model_dir)
    o_proj = loaded.model.weights.layers[0].o_proj
    packed = isinstance(o_proj, QuantizedWeight) and isinstance(o_proj.segments[0], PackedSegment)
    out[model_dir] = {"packed": packed, "greedy": kvgate_greedy(loaded, PROMPTS[:2])}
print(json.dumps(out))
"""


def test_kept_as_stored_the_triton_kernels_give_transformers_greedy_ids(
    written: dict[str, Written],
) -> None:
    """The executor with AWQ, GPTQ (act-order) and FP8 projections kept as stored and run by
    the Triton dequantize-in-the-GEMM kernels (interpreted on this CPU, in a process of its own:
    Triton fixes its mode at import) answers as transformers does on the weights stored."""
    names = ["awq", "gptq-4bit-act-order", "fp8-per-row"]
    dirs = [str(written[n].model_dir) for n in names]
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(Path.cwd())}
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_RUN, *dirs],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for name, model_dir in zip(names, dirs, strict=True):
        assert got[model_dir]["packed"], name
        assert got[model_dir]["greedy"] == written[name].greedy_ids[:2], name
