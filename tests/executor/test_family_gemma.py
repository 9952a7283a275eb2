"""Gemma 2 and Gemma 3 (text) against checkpoints transformers 5 wrote.

Both: norms stored as offsets (``(1 + w) x̂``, folded at load), embeddings times √hidden, a GELU
(tanh) MLP between pre- and post-feedforward norms, attention output normed before the add,
scores scaled by ``query_pre_attn_scalar``, sliding layers with a window of 8 (prompts of 12 and
17 tokens, outputs carried past it). Gemma 2: attention scores soft-capped at 5 and logits at 10.
Gemma 3: QK-norm, local layers with their own RoPE (θ 10⁴), global ones linear-scaled (θ 10⁶).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.executor.config import parse_config
from kvgate.executor.loader import load_model
from kvgate.executor.rope_config import LayerType, RopeType
from tests.executor.family_cases import FAMILIES, WINDOW
from tests.executor.family_checks import assert_core, assert_logprobs_close, assert_old_layout
from tests.executor.hf_checkpoints import Written, config_of

GROUP = ["gemma2", "gemma3_text"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    return {name: FAMILIES[name].write(name, tmp_path_factory.mktemp(name)) for name in GROUP}


@pytest.mark.parametrize("name", GROUP)
def test_greedy_ids_equal_transformers(written: dict[str, Written], name: str) -> None:
    assert max(len(p) for p in written[name].prompts) > WINDOW
    assert_core(written[name])


@pytest.mark.parametrize("name", GROUP)
def test_the_transformers_4_layout_gives_the_same_ids(
    written: dict[str, Written], name: str, tmp_path: Path
) -> None:
    assert_old_layout(written[name], tmp_path)


@pytest.mark.parametrize("name", GROUP)
def test_logprobs_within_tolerance(written: dict[str, Written], name: str) -> None:
    assert_logprobs_close(written[name], written[name].model_dir)


def test_layers_get_their_window_rope_and_scale(written: dict[str, Written]) -> None:
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
