"""RoPE settings read from a ``config.json`` in either layout transformers writes.

- transformers 5: ``rope_parameters``, one object (``rope_type``, ``rope_theta``, ``factor``, …),
  or one object per layer type (``{"full_attention": {...}, "sliding_attention": {...}}``: Gemma
  3's layout).
- transformers 4: a top-level ``rope_theta`` and ``rope_scaling`` (``rope_type`` or the older
  ``type``, ``factor``, …; ``null`` for no scaling), plus what a model type adds (Gemma 3's
  ``rope_local_base_freq``, the θ of its sliding layers, with ``rope_scaling`` acting on its
  global layers only; Phi-3's top-level ``original_max_position_embeddings``).

Published checkpoints come in both layouts, and transformers 5 still reads the old one. A reader
that knows only one layout runs the other with default settings: every request completes, with
wrong tokens. So both are read, and

- a value stated in two places must agree, else the checkpoint is refused naming both places
  (transformers 5 would take one over the other; guessing which the author meant is not ours);
- every key inside a RoPE object must be one its ``rope_type`` uses, and a type's required
  parameters must all be present (transformers requires them too); an optional parameter takes
  transformers' default, named in :data:`_PARAMETERS`;
- RoPE types kvgate does not implement are refused by name;
- θ may be absent from every layout: transformers' default for the model type then applies
  (:class:`RopeRules`), as it would in transformers.

This module imports no torch; :mod:`kvgate.executor.rope` turns a :class:`Rope` into tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.executor.checkpoint_error import CheckpointError

# transformers' ``default_theta``: the base it uses when a config names no θ at all.
DEFAULT_ROPE_THETA = 10000.0


class RopeType(StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    DYNAMIC = "dynamic"
    LONGROPE = "longrope"


# Types transformers implements that kvgate does not (yet): named in the refusal.
_NOT_IMPLEMENTED_TYPES = ("proportional", "axial")


class LayerType(StrEnum):
    """transformers' ``layer_types`` values kvgate knows (per-layer RoPE is keyed by them)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"


class RopeScaling(BaseModel):
    """RoPE frequency scaling. The defaults serve code that builds one directly; a config's
    required scaling parameters are always stated (see :func:`read_rope`).

    ``original_max_position_embeddings`` is the context the model was trained with: for
    ``dynamic`` it is the config's ``max_position_embeddings`` (transformers' dynamic NTK grows θ
    past it), filled in by :func:`read_rope`.
    """

    model_config = ConfigDict(frozen=True)

    rope_type: RopeType = RopeType.DEFAULT
    factor: Annotated[float, Field(gt=0.0)] = 1.0
    low_freq_factor: Annotated[float, Field(gt=0.0)] = 1.0
    high_freq_factor: Annotated[float, Field(gt=0.0)] = 4.0
    original_max_position_embeddings: Annotated[int, Field(ge=1)] = 8192
    # yarn and longrope: cos and sin are multiplied by it; None: derived from the factor.
    attention_factor: Annotated[float, Field(gt=0.0)] | None = None
    beta_fast: float = 32.0  # yarn: rotations per context below which dimensions interpolate
    beta_slow: float = 1.0  # yarn: ... above which they extrapolate
    mscale: float | None = None  # yarn (DeepSeek): terms of the derived attention factor
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope: per frequency, short contexts
    long_factor: tuple[float, ...] | None = None  # longrope: per frequency, long contexts


class Rope(BaseModel):
    """One rotary embedding: the base θ and the frequency scaling applied to it."""

    model_config = ConfigDict(frozen=True)

    theta: Annotated[float, Field(gt=0.0)]
    scaling: RopeScaling = RopeScaling()

    def describe(self) -> str:
        """``llama3 θ=500000 (factor 8, ...)``: what the load log shows."""
        scaling = self.scaling
        text = f"{scaling.rope_type} θ={self.theta:g}"
        keys = _PARAMETERS[scaling.rope_type].names
        values = [_describe_value(k, getattr(scaling, k)) for k in keys]
        shown = [v for v in values if v is not None]
        return text + (" (" + ", ".join(shown) + ")" if shown else "")


def _describe_value(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return f"{key} [{len(value)} values]"
    if isinstance(value, bool):
        return f"{key} {str(value).lower()}"
    return f"{key} {value:g}"


@dataclass(frozen=True)
class _Parameters:
    """The keys a RoPE type reads: required ones, and optional ones with transformers' default
    (the field's default in :class:`RopeScaling`)."""

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.required + self.optional


_PARAMETERS: dict[RopeType, _Parameters] = {
    RopeType.DEFAULT: _Parameters(),
    RopeType.LINEAR: _Parameters(("factor",)),
    RopeType.LLAMA3: _Parameters(
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    ),
    RopeType.YARN: _Parameters(
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    RopeType.DYNAMIC: _Parameters(("factor",)),
    RopeType.LONGROPE: _Parameters(
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor"),
    ),
}
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
ROPE_LAYOUT_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")
_ALL_LAYER_TYPES = frozenset(LayerType)


@dataclass(frozen=True)
class RopeRules:
    """How one model type's config states its RoPE, beyond the common layouts."""

    # transformers' θ when a layer type's RoPE names none (Gemma 3: 10⁶ global, 10⁴ local).
    default_theta: Mapping[LayerType, float] = field(
        default_factory=lambda: dict.fromkeys(LayerType, DEFAULT_ROPE_THETA)
    )
    # The transformers 4 key stating each layer type's θ (Gemma 3's sliding layers:
    # rope_local_base_freq); every other type reads rope_theta.
    legacy_theta_key: Mapping[LayerType, str] = field(default_factory=dict)
    # The layer types transformers 4's rope_scaling acts on (Gemma 3: global layers only).
    legacy_scaling_layers: frozenset[LayerType] = _ALL_LAYER_TYPES
    # transformers reads rope_parameters per layer type only (Gemma 3): one flat object is
    # refused, and a layer type it leaves out takes the legacy keys or the defaults.
    per_layer_type: bool = False
    # Phi-3: the top-level original_max_position_embeddings (transformers' default 4096) is the
    # one transformers gives every RoPE object that reads it.
    top_level_original_context: int | None = None
    # Older names transformers maps onto a type (Phi-3: "su" and "yarn" are its LongRoPE).
    type_aliases: Mapping[str, RopeType] = field(default_factory=dict)
    # The types the model type's transformers code accepts (None: every implemented one).
    types: frozenset[RopeType] | None = None

    def theta_key(self, layer_type: LayerType) -> str:
        return self.legacy_theta_key.get(layer_type, "rope_theta")


@dataclass(frozen=True)
class RopeReading:
    by_layer_type: dict[LayerType, Rope]  # every layer type the config gives a RoPE for
    layouts: tuple[str, ...]  # the top-level keys it was read from (for the load log)
    theta_defaulted: bool  # no layout names θ: transformers' default applies


@dataclass(frozen=True)
class _Stated:
    """What one place in the config says about RoPE; None where it says nothing."""

    theta: float | None
    theta_at: str
    scaling: RopeScaling | None
    scaling_at: str


def read_rope(
    raw: Mapping[str, Any], rules: RopeRules | None = None, max_position_embeddings: int = 4096
) -> RopeReading:
    """The RoPE of each layer type, from both layouts (raises CheckpointError).

    ``max_position_embeddings`` is the config's: dynamic NTK scaling grows θ past it, and
    LongRoPE without a ``factor`` derives one from it.
    """
    rules = rules or RopeRules()
    context = _Context(rules, max_position_embeddings, _original_context(raw, rules))
    layer_keys = set(rules.legacy_theta_key.values())
    layouts = tuple(k for k in (*ROPE_LAYOUT_KEYS, *sorted(layer_keys)) if k in raw)
    legacy = {t: _legacy_statements(raw, t, context) for t in LayerType}
    parameters = raw.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise CheckpointError(f"rope_parameters must be an object, got {parameters!r}")
    if not parameters:  # absent, null or {}: transformers too reads the old layout alone
        stated = dict(legacy)
    elif not all(v is None or isinstance(v, dict) for v in parameters.values()):
        stated = _one_object(parameters, legacy, context)
    else:
        stated = _per_layer_type(parameters, legacy, raw.get("rope_scaling"), context)
    ropes: dict[LayerType, Rope] = {}
    defaulted = False
    for layer_type, statements in stated.items():
        scaling, theta = _agree(statements)
        defaulted = defaulted or theta is None
        ropes[layer_type] = Rope(
            theta=rules.default_theta[layer_type] if theta is None else theta,
            scaling=scaling,
        )
    return RopeReading(ropes, layouts, defaulted)


def _one_object(
    parameters: dict[str, Any], legacy: dict[LayerType, list[_Stated]], context: _Context
) -> dict[LayerType, list[_Stated]]:
    """One ``rope_parameters`` object for every layer type."""
    if context.rules.per_layer_type:
        raise CheckpointError(
            "rope_parameters is one object, but this model type reads one per layer type "
            "(full_attention, sliding_attention): transformers would not apply it"
        )
    flat = _read_object(parameters, "rope_parameters", context)
    return {t: [flat, *legacy[t]] for t in LayerType}


def _per_layer_type(
    parameters: dict[str, Any],
    legacy: dict[LayerType, list[_Stated]],
    rope_scaling: Any,
    context: _Context,
) -> dict[LayerType, list[_Stated]]:
    """One ``rope_parameters`` object per layer type; the legacy keys must agree with each."""
    per_layer_type = context.rules.per_layer_type
    if rope_scaling is not None and not per_layer_type:
        raise CheckpointError(
            "config.json has both rope_scaling and per-layer-type rope_parameters "
            f"({', '.join(parameters)}): refusing to guess which one holds"
        )
    stated: dict[LayerType, list[_Stated]] = {}
    for name, obj in parameters.items():
        layer_type = _layer_type(name)
        stated[layer_type] = [_read_object(obj, f"rope_parameters.{name}", context)]
        stated[layer_type] += legacy[layer_type]
    if per_layer_type:  # the types left out take the legacy keys or the defaults
        stated |= {t: legacy[t] for t in LayerType if t not in stated}
    return stated


@dataclass(frozen=True)
class _OriginalContext:
    value: int
    where: str  # how a refusal names it


@dataclass(frozen=True)
class _Context:
    rules: RopeRules
    max_position_embeddings: int
    original_context: _OriginalContext | None  # Phi-3's top-level one, where the rules read it


def _original_context(raw: Mapping[str, Any], rules: RopeRules) -> _OriginalContext | None:
    if rules.top_level_original_context is None:
        return None
    value = raw.get("original_max_position_embeddings", rules.top_level_original_context)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"original_max_position_embeddings must be a positive integer, got {value!r}"
        )
    where = "original_max_position_embeddings"
    if "original_max_position_embeddings" not in raw:
        where += " (absent: transformers' default)"
    return _OriginalContext(value, where)


def _legacy_statements(
    raw: Mapping[str, Any], layer_type: LayerType, context: _Context
) -> list[_Stated]:
    """transformers 4's top-level θ and ``rope_scaling`` (``null``: no scaling) for one type."""
    stated: list[_Stated] = []
    key = context.rules.theta_key(layer_type)
    if raw.get(key) is not None:
        stated.append(_Stated(_number(raw[key], key), key, None, ""))
    if "rope_scaling" in raw and layer_type in context.rules.legacy_scaling_layers:
        scaling = raw["rope_scaling"]
        if scaling is None:
            stated.append(_Stated(None, "", RopeScaling(), "rope_scaling"))
        else:
            stated.append(_read_object(scaling, "rope_scaling", context))
    return stated


def _read_object(obj: Any, where: str, context: _Context) -> _Stated:
    """One RoPE object: its type, its type's parameters, θ if it names one."""
    if not isinstance(obj, dict):
        if obj is None:
            raise CheckpointError(f"{where} is null (a layer type without RoPE): not supported")
        raise CheckpointError(f"{where} must be an object, got {obj!r}")
    rope_type = _rope_type(obj, where, context.rules)
    parameters = _PARAMETERS[rope_type]
    unknown = sorted(set(obj) - _COMMON_KEYS - set(parameters.names))
    if unknown:
        found = ", ".join(f"{where}.{k}={obj[k]!r}" for k in unknown)
        raise CheckpointError(f"{found}: not a parameter of RoPE type {rope_type.value!r}")
    values = {k: obj[k] for k in parameters.names if obj.get(k) is not None}
    top = context.original_context
    if top is not None and "original_max_position_embeddings" in parameters.required:
        stated = values.setdefault("original_max_position_embeddings", top.value)
        if stated != top.value:
            raise CheckpointError(
                "config.json states the RoPE original context twice and they disagree: "
                f"{where}.original_max_position_embeddings = {stated!r} but {top.where} = "
                f"{top.value} (transformers takes the top-level one)"
            )
    missing = [k for k in parameters.required if k not in values]
    if missing:
        raise CheckpointError(
            f"{where} of RoPE type {rope_type.value!r} lacks {', '.join(missing)}"
        )
    # What transformers derives from the config's context length, made explicit: dynamic NTK
    # grows θ past max_position_embeddings; LongRoPE's factor defaults to the ratio of the two.
    if rope_type is RopeType.DYNAMIC:
        values["original_max_position_embeddings"] = context.max_position_embeddings
    if rope_type is RopeType.LONGROPE and "factor" not in values:
        original = values["original_max_position_embeddings"]
        values["factor"] = context.max_position_embeddings / original
    partial = obj.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise CheckpointError(
            f"unsupported {where}.partial_rotary_factor={partial!r}: kvgate rotates whole heads"
        )
    try:
        scaling = RopeScaling(rope_type=rope_type, **values)
    except ValidationError as exc:
        raise CheckpointError(f"invalid {where}: {exc}") from exc
    theta = obj.get("rope_theta")
    theta_at = f"{where}.rope_theta"
    return _Stated(None if theta is None else _number(theta, theta_at), theta_at, scaling, where)


def _rope_type(obj: dict[str, Any], where: str, rules: RopeRules) -> RopeType:
    named = {str(obj[k]) for k in ("rope_type", "type") if obj.get(k) is not None}
    if len(named) > 1:
        raise CheckpointError(f"{where} names two RoPE types: {sorted(named)}")
    kind = named.pop() if named else RopeType.DEFAULT.value
    if kind in rules.type_aliases:
        return rules.type_aliases[kind]
    allowed = rules.types or frozenset(RopeType)
    if kind not in {t.value for t in allowed}:
        supported = ", ".join(t.value for t in RopeType if t in allowed)
        later = " (not implemented yet)" if kind in _NOT_IMPLEMENTED_TYPES else ""
        raise CheckpointError(
            f"unsupported {where} type {kind!r}{later}: kvgate implements {supported}"
            + (" for this model type" if rules.types is not None else "")
        )
    return RopeType(kind)


def _agree(stated: list[_Stated]) -> tuple[RopeScaling, float | None]:
    """The one scaling and θ every place states (no scaling, no θ where none does)."""
    thetas = [(s.theta_at, s.theta) for s in stated if s.theta is not None]
    scalings = [(s.scaling_at, s.scaling) for s in stated if s.scaling is not None]
    _check_agreement("θ", thetas)
    _check_agreement("scaling", scalings)
    scaling = scalings[0][1] if scalings else None
    return scaling or RopeScaling(), thetas[0][1] if thetas else None


def _check_agreement(what: str, values: Sequence[tuple[str, object]]) -> None:
    for other_at, other in values[1:]:
        first_at, first = values[0]
        if other != first:
            raise CheckpointError(
                f"config.json states the RoPE {what} twice and they disagree: "
                f"{first_at} = {_show(first)} but {other_at} = {_show(other)}"
            )


def _layer_type(name: str) -> LayerType:
    if name not in {t.value for t in LayerType}:
        known = ", ".join(t.value for t in LayerType)
        raise CheckpointError(
            f"rope_parameters names layer type {name!r}, which kvgate does not run (known: {known})"
        )
    return LayerType(name)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CheckpointError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def _show(value: object) -> str:
    if isinstance(value, RopeScaling):
        parameters = _PARAMETERS[value.rope_type]
        inner = "".join(f", {k}={getattr(value, k)!r}" for k in parameters.names)
        return f"{{rope_type={value.rope_type.value!r}{inner}}}"
    return repr(value)
