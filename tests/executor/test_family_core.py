"""Every dense family against the checkpoint transformers 5 wrote for it (family_cases.FAMILIES):
Mistral, Qwen2 and Qwen3 with sliding windows; Qwen3 and OLMo 2, the QK-norm families (Qwen3
normalizes each query and key head with one ``[head_dim]`` weight, OLMo 2 the whole projections
and norms after attention and MLP instead of before); Phi-3 with and without LongRoPE; Llama with
yarn and dynamic NTK RoPE; Gemma 2 and Gemma 3.

Each: transformers' greedy ids through the real executor (batched, chunked, one request swapped
out and one recomputed), the same ids from the config.json transformers 4 would have written,
and every top log-probability within tolerance. What one family adds is tested in its own file
(test_family_gemma.py, test_family_phi3.py, ...); the slow tier runs every plan shape
(test_family_matrix.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executor.family_cases import FAMILIES, WrittenFamilies
from tests.executor.family_checks import assert_core, assert_logprobs_close, assert_old_layout

NAMES = list(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_ids_equal_transformers(written: WrittenFamilies, name: str) -> None:
    assert_core(written[name])


@pytest.mark.parametrize("name", NAMES)
def test_the_transformers_4_layout_gives_the_same_ids(
    written: WrittenFamilies, name: str, tmp_path: Path
) -> None:
    assert_old_layout(written[name], tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_logprobs_within_tolerance(written: WrittenFamilies, name: str) -> None:
    assert_logprobs_close(written[name], written[name].model_dir)
