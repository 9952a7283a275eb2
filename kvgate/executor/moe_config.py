"""Mixture-of-experts settings of a ``config.json``: which layers route, to how many experts, how.

Read for the model types whose tables in :mod:`config_keys` list these keys (``mixtral``,
``qwen2_moe``, ``qwen3_moe``), with transformers 5.24's meaning of each:

| key | mixtral | qwen2_moe / qwen3_moe |
|---|---|---|
| experts | ``num_local_experts`` | ``num_experts`` (qwen3_moe: or ``num_local_experts``) |
| experts per token | ``num_experts_per_tok`` | ``num_experts_per_tok`` |
| expert width | ``intermediate_size`` | ``moe_intermediate_size`` |
| renormalise the top-k | always | ``norm_topk_prob`` (default false) |
| sparse layer i | all | i not in ``mlp_only_layers``, ``(i + 1) % decoder_sparse_step == 0`` |
| shared expert | none | qwen2_moe: ``shared_expert_intermediate_size``, sigmoid-gated |

transformers aliases ``num_experts`` and ``num_local_experts`` in the mixtral and qwen3_moe
configs (5.24 writes ``num_local_experts`` for both; published Qwen3 checkpoints say
``num_experts``): either is read there, and both must agree. qwen2_moe knows ``num_experts``
only. ``use_sliding_window`` true is refused for the Qwen types (their sliding rules are not
implemented).

Dense layers of a sparse model (qwen's ``mlp_only_layers``) are the ordinary SwiGLU MLP of width
``intermediate_size``. The shape keys must be present (a default would only meet the checkpoint's
shapes by chance); the switches take transformers' defaults, as transformers reads the same file.

This module imports no torch: the configuration is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.executor.checkpoint_error import CheckpointError


class ExpertNaming(StrEnum):
    """Where a checkpoint stores a layer's router and experts (under ``model.layers.{i}.``)."""

    # block_sparse_moe.gate; block_sparse_moe.experts.{e}.w1 (gate), .w3 (up), .w2 (down)
    MIXTRAL = "mixtral"
    # mlp.gate; mlp.experts.{e}.gate_proj, .up_proj, .down_proj; mlp.shared_expert.*,
    # mlp.shared_expert_gate
    QWEN = "qwen"


class MoeConfig(BaseModel):
    """The routed MLP of the sparse layers; the other layers keep the dense MLP."""

    model_config = ConfigDict(frozen=True)

    num_experts: Annotated[int, Field(ge=1)]
    top_k: Annotated[int, Field(ge=1)]
    normalize_top_k: bool  # the k chosen probabilities rescaled to sum to 1
    expert_intermediate_size: Annotated[int, Field(ge=1)]
    sparse_layers: tuple[bool, ...]  # per layer: True routes to experts, False is dense
    shared_expert_intermediate_size: Annotated[int, Field(ge=1)] | None = None
    naming: ExpertNaming

    @model_validator(mode="after")
    def _top_k_within_experts(self) -> MoeConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} exceeds the {self.num_experts} experts"
            )
        return self

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]

    def width_of(self, name: str) -> int | None:
        """The intermediate width a routed or shared expert's tensor ``name`` is cut along in
        tensor parallel; None for every other tensor (the dense MLP's included)."""
        if ".experts." in name:
            return self.expert_intermediate_size
        if ".shared_expert." in name:
            return self.shared_expert_intermediate_size
        return None

    def shard_refusal(self, world_size: int) -> str | None:
        """Why the experts do not split over ``world_size`` ranks; None when they do."""
        widths = {"the experts' intermediate size": self.expert_intermediate_size}
        if self.shared_expert_intermediate_size is not None:
            widths["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        for name, width in widths.items():
            if width % world_size:
                return f"{name} {width} is not divisible by --tensor-parallel-size {world_size}"
        return None

    def sharded(self, world_size: int) -> MoeConfig:
        """One rank's part: every expert, each with its share of the intermediate columns."""
        shared = self.shared_expert_intermediate_size
        return self.model_copy(
            update={
                "expert_intermediate_size": self.expert_intermediate_size // world_size,
                "shared_expert_intermediate_size": None if shared is None else shared // world_size,
            }
        )


@dataclass(frozen=True)
class _MoeKeys:
    experts: tuple[str, ...]  # the type's key, then the alias transformers maps onto it
    width: str  # the key of each expert's intermediate size
    every_layer_sparse: bool  # False: mlp_only_layers and decoder_sparse_step decide
    always_normalize: bool  # False: norm_topk_prob decides
    shared_expert: bool
    naming: ExpertNaming


_MOE_TYPES = {
    "mixtral": _MoeKeys(
        ("num_local_experts", "num_experts"),
        "intermediate_size",
        every_layer_sparse=True,
        always_normalize=True,
        shared_expert=False,
        naming=ExpertNaming.MIXTRAL,
    ),
    "qwen3_moe": _MoeKeys(
        ("num_experts", "num_local_experts"),
        "moe_intermediate_size",
        every_layer_sparse=False,
        always_normalize=False,
        shared_expert=False,
        naming=ExpertNaming.QWEN,
    ),
    "qwen2_moe": _MoeKeys(
        ("num_experts",),  # Qwen2MoeConfig has no alias: num_local_experts is not its key
        "moe_intermediate_size",
        every_layer_sparse=False,
        always_normalize=False,
        shared_expert=True,
        naming=ExpertNaming.QWEN,
    ),
}


def read_moe(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The MoE settings of ``raw``, None for a dense model type (CheckpointError: a bad key)."""
    keys = _MOE_TYPES.get(model_type)
    if keys is None:
        return None
    if not keys.every_layer_sparse and raw.get("use_sliding_window"):
        # transformers slides every qwen3_moe layer, and the odd qwen2_moe layers below
        # max_window_layers: rules of their own, which no published checkpoint switches on.
        raise CheckpointError(
            f"unsupported use_sliding_window=true (model_type {model_type}): kvgate serves "
            "Qwen MoE models without their sliding windows only"
        )
    num_experts = _num_experts(raw, keys.experts)
    required = ["num_experts_per_tok", keys.width]
    if keys.shared_expert:
        required.append("shared_expert_intermediate_size")
    missing = [key for key in required if raw.get(key) is None]
    if missing:
        raise CheckpointError(f"{model_type} config.json lacks {', '.join(missing)}")
    try:
        return MoeConfig(
            num_experts=num_experts,
            top_k=raw["num_experts_per_tok"],
            normalize_top_k=keys.always_normalize or bool(raw.get("norm_topk_prob", False)),
            expert_intermediate_size=raw[keys.width],
            sparse_layers=_sparse_layers(raw, keys, num_layers),
            shared_expert_intermediate_size=(
                raw["shared_expert_intermediate_size"] if keys.shared_expert else None
            ),
            naming=keys.naming,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"invalid {model_type} expert settings: {exc}") from exc


def _num_experts(raw: dict[str, Any], names: tuple[str, ...]) -> int:
    """The experts' count under the type's key or transformers' alias (equal when both)."""
    values = {name: raw[name] for name in names if raw.get(name) is not None}
    if not values:
        raise CheckpointError(f"config.json lacks {names[0]}")
    if len(set(values.values())) > 1:
        listing = " but ".join(f"{name}={value}" for name, value in values.items())
        raise CheckpointError(f"config.json has {listing}")
    (value,) = set(values.values())
    if not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{names[0]} must be a positive integer, got {value!r}")
    return value


def _sparse_layers(raw: dict[str, Any], keys: _MoeKeys, num_layers: int) -> tuple[bool, ...]:
    """transformers' rule (Qwen2MoeDecoderLayer): experts unless listed in ``mlp_only_layers``
    or off the ``decoder_sparse_step`` grid."""
    if keys.every_layer_sparse:
        return (True,) * num_layers
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise CheckpointError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


@dataclass(frozen=True)
class ExpertNames:
    """A sparse layer's tensor names: ``{block}.gate.weight`` (the router),
    ``{block}.experts.{e}.{gate|up|down}.weight``, and the shared expert under ``{block}``."""

    block: str  # e.g. model.layers.3.block_sparse_moe
    gate: str
    up: str
    down: str


_NAMES = {
    ExpertNaming.MIXTRAL: ("block_sparse_moe", "w1", "w3", "w2"),
    ExpertNaming.QWEN: ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def expert_names(moe: MoeConfig, layer: int) -> ExpertNames:
    block, gate, up, down = _NAMES[moe.naming]
    return ExpertNames(f"model.layers.{layer}.{block}", gate, up, down)


def moe_tensor_shapes(moe: MoeConfig, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of sparse layer ``layer`` (router, experts, shared)."""
    names = expert_names(moe, layer)
    inter = moe.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{names.block}.gate.weight": (moe.num_experts, hidden)}
    for expert in range(moe.num_experts):
        base = f"{names.block}.experts.{expert}"
        shapes[f"{base}.{names.gate}.weight"] = (inter, hidden)
        shapes[f"{base}.{names.up}.weight"] = (inter, hidden)
        shapes[f"{base}.{names.down}.weight"] = (hidden, inter)
    shared = moe.shared_expert_intermediate_size
    if shared is not None:
        base = f"{names.block}.shared_expert"
        shapes |= {
            f"{base}.gate_proj.weight": (shared, hidden),
            f"{base}.up_proj.weight": (shared, hidden),
            f"{base}.down_proj.weight": (hidden, shared),
            f"{names.block}.shared_expert_gate.weight": (1, hidden),
        }
    return shapes
