"""Reading Hugging Face safetensors checkpoints: one file, or shards listed by an index file.

Every tensor the configuration implies must be present with exactly the implied shape, and nothing
else may be (a stray tensor means the config and the checkpoint disagree). Errors name the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvgate.gpu_executor.config import CheckpointError, ModelConfig
from kvgate.gpu_executor.tensor_parallel.shards import ShardPlan
from kvgate.protocol.enums import ModelFamily

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters write next to the weights; they are recomputed, never read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_NAMES_IN_ERROR = 8


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor a checkpoint of ``config`` holds."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    if config.family is ModelFamily.LOOPED:
        shapes["model.early_exit_gate.weight"] = (1, hidden)
        shapes["model.early_exit_gate.bias"] = (1,)
    for layer in range(config.num_layers):
        attn = f"{layer_prefix(layer)}.self_attn"
        mlp = f"{layer_prefix(layer)}.mlp"
        shapes |= {
            f"{attn}.q_proj.weight": (q_dim, hidden),
            f"{attn}.k_proj.weight": (kv_dim, hidden),
            f"{attn}.v_proj.weight": (kv_dim, hidden),
            f"{attn}.o_proj.weight": (hidden, q_dim),
            f"{mlp}.gate_proj.weight": (inter, hidden),
            f"{mlp}.up_proj.weight": (inter, hidden),
            f"{mlp}.down_proj.weight": (hidden, inter),
            f"{layer_prefix(layer)}.input_layernorm.weight": (hidden,),
            f"{layer_prefix(layer)}.post_attention_layernorm.weight": (hidden,),
        }
        if config.qkv_bias:
            shapes |= {
                f"{attn}.q_proj.bias": (q_dim,),
                f"{attn}.k_proj.bias": (kv_dim,),
                f"{attn}.v_proj.bias": (kv_dim,),
            }
        if config.o_bias:
            shapes[f"{attn}.o_proj.bias"] = (hidden,)
        if config.sandwich_norm:
            shapes[f"{layer_prefix(layer)}.input_layernorm_2.weight"] = (hidden,)
            shapes[f"{layer_prefix(layer)}.post_attention_layernorm_2.weight"] = (hidden,)
    return shapes


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
    """Every checkpoint tensor, checked against ``config``, as ``dtype`` on ``device``.

    With ``shard``, only this rank's slice of each tensor is read from the file (safetensors
    reads slices without loading the rest), under the tensor's own name.
    """
    shapes = expected_shapes(config)
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
                if shape != shapes[name]:
                    raise CheckpointError(
                        f"tensor {name} has shape {shape}, config.json implies {shapes[name]}"
                    )
                part = None if shard is None else shard.slice_of(name, config)
                if part is None:
                    tensor = view[:]
                elif part.dim == 0:
                    tensor = view[part.start : part.stop]
                else:
                    tensor = view[:, part.start : part.stop]
                if not tensor.is_floating_point():
                    raise CheckpointError(f"tensor {name} has non-float dtype {tensor.dtype}")
                tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors if shard is None else pad_vocab_shards(tensors, shard, config)


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
