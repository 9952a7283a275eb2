"""Gemma 2 and Gemma 3 (text) against checkpoints transformers 5 wrote.

Both: norms stored as offsets (``(1 + w) x̂``, folded at load), embeddings times √hidden, a GELU
(tanh) MLP between pre- and post-feedforward norms, attention output normed before the add,
scores scaled by ``query_pre_attn_scalar``, sliding layers with a window of 8 (prompts of 12 and
17 tokens, outputs carried past it). Gemma 2: attention scores soft-capped at 5 and logits at 10.
Gemma 3: QK-norm, local layers with their own RoPE (θ 10⁴), global ones linear-scaled (θ 10⁶).
"""

from __future__ import annotations

from kvgate.executor.config import parse_config
from kvgate.executor.loader import load_model
from kvgate.executor.rope_config import LayerType, RopeType
from tests.executor.family_cases import WINDOW, WrittenFamilies
from tests.executor.hf_checkpoints import config_of


def test_the_prompts_reach_past_the_window(written: WrittenFamilies) -> None:
    """The core checks (test_family_core.py) cross the sliding layers' window."""
    for name in ("gemma2", "gemma3_text"):
        assert max(len(p) for p in written[name].prompts) > WINDOW


def test_layers_get_their_window_rope_and_scale(written: WrittenFamilies) -> None:
    model = load_model(written["gemma3_text"].model_dir).model
    settings = [layer.attention.settings for layer in model.layers]
    assert [s.sliding_window for s in settings] == [WINDOW, None, WINDOW]
    assert {s.softmax_scale for s in settings} == {20**-0.5}
    assert [layer.attention.rope for layer in model.layers] == [0, 1, 0]  # two tables
    assert model.attention_windows == (WINDOW, None)
    ropes = model.config.rope_by_layer_type
    assert ropes[LayerType.FULL_ATTENTION].scaling.rope_type is RopeType.LINEAR
    assert ropes[LayerType.SLIDING_ATTENTION].theta == 1e4
    gemma2 = parse_config(config_of(written["gemma2"].model_dir))
    assert gemma2.attn_logit_softcap == 5.0 and gemma2.final_logit_softcap == 10.0
    assert [gemma2.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
