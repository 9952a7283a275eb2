"""Which layers slide, how far, and how long a context the model serves: read from a
``config.json`` with each model type's transformers rules (:class:`LayerTypeRule`).

```
layer types   layer_types when the config lists them, else the type's rule:
              all_sliding (Mistral, Phi-3), qwen (use_sliding_window; from max_window_layers),
              alternating (Gemma 2), pattern (Gemma 3's sliding_window_pattern, default 6)
window        sliding_window; for the qwen rule only with use_sliding_window (transformers
              drops the window otherwise, whatever layer_types says)
context       max_position_embeddings, longer for RoPE that extends it (yarn, dynamic), capped
              at the window for types that cap (WindowRule.CAPS_CONTEXT)
```

This module imports no torch: the configuration is plain data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvgate.executor.architecture import WindowRule
from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.config_keys import LayerTypeRule, ModelTypeKeys
from kvgate.executor.rope_config import LayerType, Rope, RopeType

_DEFAULT_CONTEXT = 4096  # max_position_embeddings when a config names none


def read_window(raw: Mapping[str, Any], keys: ModelTypeKeys) -> int | None:
    """The window of the sliding layers as the config switches it on; None: no window."""
    window = raw.get("sliding_window")
    if window is None or (
        keys.layer_types is LayerTypeRule.QWEN and not raw.get("use_sliding_window")
    ):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"sliding_window must be a positive integer, got {window!r}")
    return window


def read_layer_types(
    raw: Mapping[str, Any], keys: ModelTypeKeys, num_layers: int
) -> tuple[LayerType, ...]:
    """Every layer's attention type: ``layer_types`` as listed, else the type's rule."""
    listed = raw.get("layer_types")
    if listed is not None:
        return _listed(listed)
    rule, window = keys.layer_types, read_window(raw, keys)
    if rule is LayerTypeRule.ALTERNATING:
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif rule is LayerTypeRule.PATTERN:
        pattern = raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise CheckpointError(f"sliding_window_pattern must be >= 1, got {pattern!r}")
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif rule is LayerTypeRule.QWEN:
        first = int(raw.get("max_window_layers", 28))
        sliding = [window is not None and i >= first for i in range(num_layers)]
    else:
        sliding = [window is not None] * num_layers
    return tuple(LayerType.SLIDING_ATTENTION if s else LayerType.FULL_ATTENTION for s in sliding)


def _listed(raw: Any) -> tuple[LayerType, ...]:
    """transformers' ``layer_types``: each must be a type kvgate runs, named when it is not."""
    if not isinstance(raw, list):
        raise CheckpointError(f"layer_types must be a list, got {raw!r}")
    known = {t.value for t in LayerType}
    for index, name in enumerate(raw):
        if name not in known:
            raise CheckpointError(
                f"unsupported layer type {name!r} (layer_types[{index}]): kvgate runs "
                f"{', '.join(sorted(known))}"
            )
    return tuple(LayerType(name) for name in raw)


def context_length(raw: Mapping[str, Any], keys: ModelTypeKeys, ropes: Iterable[Rope]) -> int:
    """The longest sequence served: ``max_position_embeddings``, extended by the RoPE the layers
    apply (dynamic NTK to ``factor`` times it, yarn to ``factor`` times its original context),
    capped at the window where the type caps (within the window, windowed and full causal
    attention agree)."""
    length = int(raw.get("max_position_embeddings", _DEFAULT_CONTEXT))
    for rope in ropes:
        scaling = rope.scaling
        # dynamic: θ grows past the config's max_position_embeddings (the scaling's original
        # context, see RopeScaling); yarn: trained to factor times its original context.
        if scaling.rope_type in (RopeType.DYNAMIC, RopeType.YARN):
            length = max(length, int(scaling.factor * scaling.original_max_position_embeddings))
    window = read_window(raw, keys)
    if keys.architecture.window is WindowRule.CAPS_CONTEXT and window is not None:
        length = min(length, window)
    return length
