"""Mistral, Qwen2 and Qwen3 with sliding windows shorter than the prompts, against checkpoints
transformers 5 wrote: every Mistral layer slides; Qwen2 and Qwen3 with ``use_sliding_window``
slide the layers from ``max_window_layers`` on (here the last two of three). The context is the
config's ``max_position_embeddings``, not capped at the window. Llama and OLMo 2, whose
transformers code has no window, serve a ``sliding_window`` by capping the context instead."""

from __future__ import annotations

import pytest

from kvgate.executor.config import ModelConfig, parse_config
from tests.executor.family_cases import WINDOW, WrittenFamilies
from tests.executor.hf_checkpoints import SHAPE, as_transformers_4, config_of

GROUP = ["mistral-window", "qwen2-window", "qwen3-window"]


@pytest.mark.parametrize("layout", ["transformers 5", "transformers 4"])
def test_which_layers_slide(written: WrittenFamilies, layout: str) -> None:
    """transformers 5 lists layer_types; transformers 4's files leave them to each type's rule
    (Mistral: every layer; Qwen2: from max_window_layers on), which kvgate applies itself."""

    def parsed(name: str) -> ModelConfig:
        raw = config_of(written[name].model_dir)
        return parse_config(as_transformers_4(raw) if layout == "transformers 4" else raw)

    mistral = parsed("mistral-window")
    assert [mistral.layer_window(i) for i in range(3)] == [WINDOW] * 3
    for qwen in (parsed("qwen2-window"), parsed("qwen3-window")):
        assert [qwen.layer_window(i) for i in range(3)] == [None, WINDOW, WINDOW]
        assert qwen.max_model_len == mistral.max_model_len == SHAPE["max_position_embeddings"]


@pytest.mark.parametrize("model_type", ["llama", "olmo2"])
def test_a_window_where_transformers_has_none_caps_the_context(model_type: str) -> None:
    """transformers' Llama and OLMo 2 never read sliding_window: every layer attends to the
    whole context, which equals a window only while the context is no longer than it."""
    from transformers import AutoConfig

    raw = AutoConfig.for_model(model_type, **SHAPE).to_dict() | {"sliding_window": WINDOW}
    config = parse_config(raw)
    assert [config.layer_window(i) for i in range(3)] == [None] * 3
    assert config.max_model_len == WINDOW
