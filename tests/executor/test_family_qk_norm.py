"""Qwen3 and OLMo 2, the QK-norm families, against checkpoints transformers 5 wrote.

Qwen3 normalizes each query and key head with one ``[head_dim]`` weight; OLMo 2 normalizes the
whole query and key projections (one weight over all heads) and has no norm before attention
or MLP, only after them. Each: transformers' greedy ids through the real executor (batched,
chunked, one request swapped out and one recomputed), from either config layout, and every
top log-probability within tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.family_cases import FAMILIES
from tests.executor.family_checks import assert_core, assert_logprobs_close, assert_old_layout
from tests.executor.hf_checkpoints import Written

GROUP = ["qwen3", "olmo2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    return {name: FAMILIES[name].write(name, tmp_path_factory.mktemp(name)) for name in GROUP}


@pytest.mark.parametrize("name", GROUP)
def test_greedy_ids_equal_transformers(written: dict[str, Written], name: str) -> None:
    assert_core(written[name])


@pytest.mark.parametrize("name", GROUP)
def test_the_transformers_4_layout_gives_the_same_ids(
    written: dict[str, Written], name: str, tmp_path: Path
) -> None:
    assert_old_layout(written[name], tmp_path)


@pytest.mark.parametrize("name", GROUP)
def test_logprobs_within_tolerance(written: dict[str, Written], name: str) -> None:
    assert_logprobs_close(written[name], written[name].model_dir)
