"""Loading a model: a directory (config.json + safetensors (+ tokenizer.json)) or a .gguf file.

A GGUF file (or a directory holding one as ``model.gguf``) loads with its block formats kept as
stored under ``dtype="auto"``; a stated dtype (``float32``) dequantizes every weight into it.
On CPU its products take the activations as ``activations`` says (float32 by default; int8 in
the rows8 layout where the kernel compiled: see :class:`~kvgate.protocol.enums.QuantActivations`).
An AWQ, GPTQ or FP8 checkpoint's projections likewise stay as stored under ``auto`` where
Triton's kernels run them (CUDA), and are dequantized when read elsewhere or into a stated dtype.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from kvgate.executor.config import CheckpointError, load_config
from kvgate.executor.gguf_checkpoint import GGUF_IN_DIRECTORY, is_gguf, read_gguf_checkpoint
from kvgate.executor.model import DenseMlpWeights, Model, ModelWeights, assemble_weights
from kvgate.executor.quantized import (
    Weight,
    prepare_quant_kernel,
    repacked_rows8,
    weight_nbytes,
    with_activations,
)
from kvgate.executor.tensor_parallel.layers import TensorParallel
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.executor.tokenizer import TOKENIZER_FILE, TextTokenizer, load_tokenizer
from kvgate.executor.weights import read_checkpoint, read_checkpoint_packed
from kvgate.kernels.cpu.quant import rows8_compiled
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.protocol.enums import AUTO_DTYPE, DType, QuantActivations
from kvgate.protocol.tokenizer_files import TokenizerFiles

DTypeChoice = DType | Literal["auto"] | torch.dtype

log = logging.getLogger("kvgate.executor")


_TORCH_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}


def resolve_dtype(
    dtype: DTypeChoice, device: torch.device, config_dtype: str | None
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != AUTO_DTYPE:
        return _TORCH_DTYPES[DType(dtype)]
    if device.type == "cpu":
        return torch.float32
    by_name = {d.value: t for d, t in _TORCH_DTYPES.items()} | {"float": torch.float32}
    return by_name.get(config_dtype or "", torch.bfloat16)


@dataclass(frozen=True)
class LoadedModel:
    model: Model
    tokenizer: TextTokenizer | None
    source: Path
    # What the step server hands to the admission service (GET /v1/tokenizer).
    tokenizer_files: TokenizerFiles | None = None


def load_model(
    model_dir: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: DTypeChoice = AUTO_DTYPE,
    parallel: TensorParallel | None = None,
    batch_invariant: bool = False,
    activations: QuantActivations = QuantActivations.FLOAT32,
) -> LoadedModel:
    """Read and check a model directory or GGUF file; raises CheckpointError with the reason.

    With ``parallel``, only this rank's shard is read (a ShardError, one line, when the model
    does not split over the group). ``batch_invariant``: see :class:`Model` (a ValueError where
    the device cannot run it). ``activations``: how a GGUF model's quantized products take
    their activations on CPU.
    """
    path = Path(model_dir)
    if path.is_dir() and (path / GGUF_IN_DIRECTORY).is_file():  # kvgate convert --dtype quantized
        path = path / GGUF_IN_DIRECTORY
    if is_gguf(path):
        return _load_gguf(path, torch.device(device), dtype, parallel, batch_invariant, activations)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    config = load_config(path)
    shard = None if parallel is None else parallel.plan
    local_config = config if shard is None else shard.local_config(config)
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, config.torch_dtype)
    tensors: Mapping[str, Weight]
    if config.weight_only is not None and _keeps_packed(dtype, torch_device, shard):
        tensors = read_checkpoint_packed(path, config, torch_dtype, torch_device)
        log.info(
            "%s: kept as stored, run by Triton's dequantize-in-the-GEMM kernels (%.1f MB of "
            "weights in memory)",
            config.weight_only.describe(),
            sum(weight_nbytes(t) for t in tensors.values()) / 1e6,
        )
    else:
        tensors = read_checkpoint(path, config, torch_dtype, torch_device, shard)
        if config.weight_only is not None:
            log.info(
                "%s: dequantized to %s when read (%.1f MB of weights in memory)",
                config.weight_only.describe(),
                torch_dtype,
                sum(weight_nbytes(t) for t in tensors.values()) / 1e6,
            )
    tokenizer = load_tokenizer(path)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens, the model only {config.vocab_size}"
        )
    weights = assemble_weights(local_config, tensors)
    model = Model(local_config, weights, parallel=parallel, batch_invariant=batch_invariant)
    return LoadedModel(model, tokenizer, path, _directory_tokenizer_files(path))


def _cpu_weights(weights: ModelWeights, activations: QuantActivations) -> ModelWeights:
    """The projections and the output layer as the CPU products read them.

    int8 activations: in the int8 kernel's rows8 layout where their format has one (every GGUF
    format kvgate keeps: the same bytes in groups of eight rows; 2-6.5x faster for a lone decode
    row, 1.2-2.2x for 32 rows, measured in docs/benchmarks.md) and the kernel compiled. float32:
    as stored, marked for the float product. A tied embedding is the same object as the output
    layer, so it is converted once (its lookups unpack the groups they touch)."""
    if activations is QuantActivations.INT8 and not rows8_compiled(prepare_quant_kernel()):
        return weights

    def convert(weight: Weight) -> Weight:
        if activations is QuantActivations.INT8:
            return repacked_rows8(weight)
        return with_activations(weight, activations)

    layers = []
    for layer in weights.layers:
        mlp = layer.mlp
        if isinstance(mlp, DenseMlpWeights):
            mlp = replace(
                mlp,
                gate_up_proj=convert(mlp.gate_up_proj),
                down_proj=convert(mlp.down_proj),
            )
        layers.append(
            replace(
                layer,
                qkv_proj=convert(layer.qkv_proj),
                o_proj=convert(layer.o_proj),
                mlp=mlp,
            )
        )
    lm_head = convert(weights.lm_head)
    embed = lm_head if weights.lm_head is weights.embed else weights.embed
    return replace(weights, layers=tuple(layers), lm_head=lm_head, embed=embed)


def _keeps_packed(dtype: DTypeChoice, device: torch.device, shard: ShardPlan | None) -> bool:
    """Whether a weight-only checkpoint stays as stored: ``auto`` dtype (a stated one
    dequantizes into it, as for GGUF), read whole, on a device whose Triton kernels read the
    layouts (CUDA; CPU only under the Triton interpreter: no CPU kernel reads them)."""
    return dtype == AUTO_DTYPE and shard is None and select_backend(device) is Backend.TRITON


def _directory_tokenizer_files(path: Path) -> TokenizerFiles | None:
    tokenizer_file = path / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        return None
    config_file = path / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object")
    return TokenizerFiles.of(tokenizer_file.read_text(), config)


def _load_gguf(
    path: Path,
    device: torch.device,
    dtype: DTypeChoice,
    parallel: TensorParallel | None,
    batch_invariant: bool,
    activations: QuantActivations,
) -> LoadedModel:
    torch_dtype = resolve_dtype(dtype, device, None)
    shard = None if parallel is None else parallel.plan
    # ``auto`` keeps the file's block formats where the model can run them; a stated dtype
    # dequantizes into it.
    keep = dtype == AUTO_DTYPE
    checkpoint = read_gguf_checkpoint(path, torch_dtype, device, shard, keep_quantized=keep)
    file_bytes = path.stat().st_size
    log.info(
        "weights: %.1f MB in memory, %.2fx the %.1f MB file (%s)",
        checkpoint.weight_bytes / 1e6,
        checkpoint.weight_bytes / file_bytes,
        file_bytes / 1e6,
        "quantized as stored" if checkpoint.quantized else f"dequantized to {torch_dtype}",
    )
    config = checkpoint.config if shard is None else shard.local_config(checkpoint.config)
    weights = assemble_weights(config, checkpoint.tensors)
    if checkpoint.quantized and device.type == "cpu":
        weights = _cpu_weights(weights, activations)
        log.info("quantized products: %s activations", activations.value)
    model = Model(config, weights, parallel=parallel, batch_invariant=batch_invariant)
    files = TokenizerFiles.of(
        checkpoint.tokenizer.to_str(), checkpoint.special_tokens.tokenizer_config()
    )
    return LoadedModel(model, TextTokenizer(checkpoint.tokenizer), path, files)
