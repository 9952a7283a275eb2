"""Reading Hugging Face safetensors checkpoints: one file, or shards listed by an index file.

Every tensor the configuration implies must be present with exactly the implied shape, and nothing
else may be (a stray tensor means the config and the checkpoint disagree). Errors name the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvgate.executor.architecture import QkNorm
from kvgate.executor.config import CheckpointError, ModelConfig
from kvgate.executor.moe_config import moe_tensor_shapes
from kvgate.executor.quantized import PackedSegment, QuantizedWeight, Weight
from kvgate.executor.tensor_parallel.shards import ShardPlan
from kvgate.executor.weight_only import WeightOnlyError, WeightOnlyMethod

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write next to the weights; they are recomputed, never read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_NAMES_IN_ERROR = 8


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


@dataclass(frozen=True)
class LayerTensorNames:
    """The checkpoint names of one layer's tensors, as its family stores them.

    ``qkv`` and ``gate_up`` name the parts stacked along dim 0 into one matmul: three tensors
    (``q_proj``, ``k_proj``, ``v_proj``) or the one fused tensor (Phi-3's ``qkv_proj``).
    """

    qkv: tuple[str, ...]
    qkv_bias: tuple[str, ...] | None
    o_proj: str
    o_bias: str | None
    q_norm: str | None
    k_norm: str | None
    gate_up: tuple[str, ...]
    down_proj: str
    norms: dict[str, str]  # slot (see Architecture) -> name


def layer_tensor_names(config: ModelConfig, layer: int) -> LayerTensorNames:
    architecture = config.architecture
    prefix = layer_prefix(layer)
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    qkv = (
        (f"{attn}.qkv_proj",)
        if architecture.fused_qkv
        else tuple(f"{attn}.{p}_proj" for p in "qkv")
    )
    has_qk_norm = architecture.qk_norm is not QkNorm.NONE
    return LayerTensorNames(
        qkv=tuple(f"{name}.weight" for name in qkv),
        qkv_bias=tuple(f"{name}.bias" for name in qkv) if config.qkv_bias else None,
        o_proj=f"{attn}.o_proj.weight",
        o_bias=f"{attn}.o_proj.bias" if config.o_bias else None,
        q_norm=f"{attn}.q_norm.weight" if has_qk_norm else None,
        k_norm=f"{attn}.k_norm.weight" if has_qk_norm else None,
        gate_up=(
            (f"{mlp}.gate_up_proj.weight",)
            if architecture.fused_gate_up
            else (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
        ),
        down_proj=f"{mlp}.down_proj.weight",
        norms={
            slot: f"{prefix}.{name}.weight" for slot, name in architecture.norms.slots().items()
        },
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor a checkpoint of ``config`` holds."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_dim = config.num_heads * head_dim
    kv_dim = config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    if config.architecture.exit_gate:
        shapes["model.early_exit_gate.weight"] = (1, hidden)
        shapes["model.early_exit_gate.bias"] = (1,)
    per_head = config.architecture.qk_norm is QkNorm.PER_HEAD
    # The order is the order make-tiny-model draws random tensors in: kept as it was before
    # the families arrived, so existing tiny checkpoints keep their weights.
    for layer in range(config.num_layers):
        names = layer_tensor_names(config, layer)
        qkv_rows = (q_dim, kv_dim, kv_dim) if len(names.qkv) == 3 else (q_dim + 2 * kv_dim,)
        shapes |= {name: (rows, hidden) for name, rows in zip(names.qkv, qkv_rows, strict=True)}
        shapes[names.o_proj] = (hidden, q_dim)
        if config.moe is not None and config.moe.is_sparse(layer):
            shapes |= moe_tensor_shapes(config.moe, layer, hidden)
        else:
            gate_up_rows = (inter, inter) if len(names.gate_up) == 2 else (2 * inter,)
            shapes |= {n: (r, hidden) for n, r in zip(names.gate_up, gate_up_rows, strict=True)}
            shapes[names.down_proj] = (hidden, inter)
        pre_norms = [names.norms.get(slot) for slot in ("attention_in", "mlp_in")]
        shapes |= {name: (hidden,) for name in pre_norms if name is not None}
        if names.qkv_bias is not None:
            shapes |= {n: (rows,) for n, rows in zip(names.qkv_bias, qkv_rows, strict=True)}
        if names.o_bias is not None:
            shapes[names.o_bias] = (hidden,)
        shapes |= {name: (hidden,) for name in names.norms.values() if name not in shapes}
        if names.q_norm is not None and names.k_norm is not None:
            shapes[names.q_norm] = (head_dim,) if per_head else (q_dim,)
            shapes[names.k_norm] = (head_dim,) if per_head else (kv_dim,)
    return shapes


def _projections(config: ModelConfig) -> list[str]:
    """The checkpoint names of every layer's projection weights (what weight-only methods
    quantize)."""
    out: list[str] = []
    for layer in range(config.num_layers):
        names = layer_tensor_names(config, layer)
        out += [*names.qkv, names.o_proj, *names.gate_up, names.down_proj]
    return out


def stored_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``expected_shapes`` as the file stores them: under a weight-only method each quantized
    projection's ``weight`` is replaced by the method's tensors. Also: each stored tensor of a
    quantized projection -> the projection's module name."""
    shapes = expected_shapes(config)
    scheme = config.weight_only
    owners: dict[str, str] = {}
    if scheme is None:
        return shapes, owners
    for name in _projections(config):
        module = name.removesuffix(".weight")
        if not scheme.quantizes(module):
            continue
        rows, cols = shapes.pop(name)
        try:
            stored = scheme.tensor_shapes(module, rows, cols)
        except WeightOnlyError as exc:
            raise CheckpointError(str(exc)) from None
        shapes |= stored
        owners |= dict.fromkeys(stored, module)
    return shapes, owners


def _by_module(owners: dict[str, str]) -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = {}
    for name, module in owners.items():
        by_module.setdefault(module, []).append(name)
    return by_module


def _packed(
    config: ModelConfig, tensors: dict[str, torch.Tensor], owners: dict[str, str]
) -> dict[str, Weight]:
    """``tensors`` with every quantized projection's stored tensors replaced by its ``weight``
    as a :class:`PackedSegment` (checked as :func:`_dequantized` checks them)."""
    scheme = config.weight_only
    assert scheme is not None
    logical = expected_shapes(config)
    out: dict[str, Weight] = dict(tensors)
    for module, names in _by_module(owners).items():
        rows, cols = logical[f"{module}.weight"]

        def get(suffix: str, module: str = module) -> torch.Tensor:
            return tensors[f"{module}.{suffix}"]

        try:
            if scheme.method is WeightOnlyMethod.FP8:
                segment = PackedSegment(
                    scheme.method, rows, get("weight"), get("weight_scale").float().reshape(-1)
                )
            else:
                group = scheme.group_size or cols
                g_idx = None
                if scheme.method is WeightOnlyMethod.GPTQ:
                    g_idx = get("g_idx")
                    scheme.check_group_index(module, g_idx, get("scales").shape[0])
                segment = PackedSegment(
                    scheme.method, rows, get("qweight"), get("scales"), get("qzeros"), g_idx,
                    bits=scheme.bits, group_size=group,
                )  # fmt: skip
        except WeightOnlyError as exc:
            raise CheckpointError(str(exc)) from None
        for name in names:
            del out[name]
        out[f"{module}.weight"] = QuantizedWeight((segment,), cols)
    return out


def _dequantized(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    owners: dict[str, str],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """``tensors`` with every quantized projection's stored tensors replaced by its float
    ``weight`` in ``dtype``."""
    assert config.weight_only is not None
    logical = expected_shapes(config)
    for module, names in _by_module(owners).items():
        rows, cols = logical[f"{module}.weight"]
        try:
            weight = config.weight_only.dequantize(module, tensors, rows, cols)
        except WeightOnlyError as exc:
            raise CheckpointError(str(exc)) from None
        for name in names:
            del tensors[name]
        tensors[f"{module}.weight"] = weight.to(dtype)
    return tensors


def _shard_map(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it, from the index file or by listing the single file(s)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path} has no valid weight_map: {exc}") from exc
        shards = {name: model_dir / str(file) for name, file in weight_map.items()}
        for shard in sorted(set(shards.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index_path} names shard {shard.name}, which is missing")
        return shards
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no *.safetensors file")
    shards = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 — safe_open is not a mapping
                if name in shards:
                    raise CheckpointError(
                        f"tensor {name} is in both {shards[name].name} and {file.name}"
                    )
                shards[name] = file
    return shards


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" (+{more} more)" if more > 0 else "")


def read_checkpoint(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, checked against ``config``, as ``dtype`` on ``device``; a
    weight-only checkpoint's projections dequantized into ``dtype``.

    With ``shard``, only this rank's slice of each tensor is read from the file (safetensors
    reads slices without loading the rest), under the tensor's own name.
    """
    if config.weight_only is not None and shard is not None:
        raise CheckpointError(
            f"{config.weight_only.describe()} are read whole: tensor-parallel loading of a "
            "weight-only quantized checkpoint is not supported"
        )
    tensors, owners = _read_stored(model_dir, config, dtype, device, shard)
    if owners:
        return _dequantized(config, tensors, owners, dtype)
    return tensors if shard is None else pad_vocab_shards(tensors, shard, config)


def read_checkpoint_packed(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, Weight]:
    """As :func:`read_checkpoint` for a weight-only checkpoint, its projections kept as stored:
    each a :class:`QuantizedWeight` of one :class:`PackedSegment` (for devices where Triton's
    kernels read them)."""
    if config.weight_only is None:
        raise ValueError("read_checkpoint_packed reads weight-only quantized checkpoints")
    tensors, owners = _read_stored(model_dir, config, dtype, device, None)
    return _packed(config, tensors, owners)


def _read_stored(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardPlan | None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every stored tensor, checked; float ones as ``dtype``, a weight-only method's as stored.
    Also: each stored tensor of a quantized projection -> its module."""
    shapes, owners = stored_shapes(config)
    scheme = config.weight_only
    shards = {n: f for n, f in _shard_map(model_dir).items() if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        shards.pop("lm_head.weight", None)  # tied checkpoints sometimes store the copy too
    missing = sorted(set(shapes) - set(shards))
    if missing:
        raise CheckpointError(f"checkpoint in {model_dir} is missing tensors: {_names(missing)}")
    unexpected = sorted(set(shards) - set(shapes))
    if unexpected:
        raise CheckpointError(
            f"checkpoint in {model_dir} has tensors its config.json does not describe: "
            f"{_names(unexpected)}"
        )
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in shards.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as handle:
            available = set(handle.keys())
            for name in sorted(names):
                if name not in available:
                    raise CheckpointError(f"index maps {name} to {file.name}, which lacks it")
                view = handle.get_slice(name)
                shape = tuple(view.get_shape())
                fits = shape == shapes[name]
                if not fits and scheme is not None and name in owners:
                    fits = scheme.shape_fits(name, shape, shapes[name])
                if not fits:
                    raise CheckpointError(
                        f"tensor {name} has shape {shape}, config.json implies {shapes[name]}"
                    )
                parts = None if shard is None else shard.parts_of(name, config)
                if parts is None:  # a 0-dim tensor (a scale) cannot be sliced
                    tensor = view[:] if shape else handle.get_tensor(name)
                else:  # a fused tensor's rank part is several ranges, read and joined
                    pieces = [
                        view[p.start : p.stop] if p.dim == 0 else view[:, p.start : p.stop]
                        for p in parts
                    ]
                    tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, parts[0].dim)
                if scheme is not None and name in owners:  # as the method stores it
                    try:
                        scheme.check_dtype(name, tensor.dtype)
                    except WeightOnlyError as exc:
                        raise CheckpointError(str(exc)) from None
                    tensors[name] = tensor.to(device=device)  # dequantized below
                    continue
                if not tensor.is_floating_point():
                    raise CheckpointError(f"tensor {name} has non-float dtype {tensor.dtype}")
                tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors, owners


def pad_vocab_shards(
    tensors: dict[str, torch.Tensor], shard: ShardPlan, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Vocabulary shards with zero rows appended, so every rank's shard has the same rows."""
    for name, tensor in tensors.items():
        rows = shard.padded_rows(name, config)
        if rows is not None and tensor.shape[0] < rows:
            padding = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
            tensors[name] = torch.cat([tensor, padding])
    return tensors
