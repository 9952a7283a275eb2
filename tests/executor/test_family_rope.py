"""yarn and dynamic NTK RoPE against checkpoints transformers 5 wrote (Llama's layer).

yarn rotates each position by fixed frequencies (interpolated below ``beta_slow`` rotations over
the original context, kept above ``beta_fast``) and scales ``cos`` and ``sin`` by its attention
factor: transformers' full forward is the reference. dynamic NTK grows θ with a call's length
past ``max_position_embeddings``; kvgate grows it with each position (``L = p + 1``), which is
transformers' result for a prompt within that context followed by one call per generated token
(the reference here). A prompt longer than it, which transformers rotates in one call with the
θ of the whole call, is where the two part (kvgate/executor/rope.py, docs/models.md).
"""

from __future__ import annotations

import logging

import pytest

from kvgate.executor.config import parse_config
from kvgate.executor.rope_config import RopeType
from tests.executor.family_cases import WrittenFamilies
from tests.executor.hf_checkpoints import config_of

GROUP = ["llama-yarn", "llama-dynamic"]


def test_the_scaled_context_is_served(written: WrittenFamilies) -> None:
    """yarn serves the context it was trained to (factor times the original); dynamic NTK
    extends max_position_embeddings by its factor. Both generations cross position 16."""
    yarn = parse_config(config_of(written["llama-yarn"].model_dir))
    dynamic = parse_config(config_of(written["llama-dynamic"].model_dir))
    assert yarn.rope.scaling.rope_type is RopeType.YARN
    assert dynamic.rope.scaling.rope_type is RopeType.DYNAMIC
    assert yarn.max_model_len == dynamic.max_model_len == 64
    assert all(len(p) + 14 > 16 for p in written["llama-dynamic"].prompts[:2])


def test_the_load_says_where_dynamic_ntk_departs_from_transformers(
    written: WrittenFamilies, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvgate.executor.config"):
        parse_config(config_of(written["llama-dynamic"].model_dir))
        parse_config(config_of(written["llama-yarn"].model_dir))
    (warning,) = [r.getMessage() for r in caplog.records]  # the dynamic model only
    assert "position p from 16 on rotates with the θ of a sequence of p + 1" in warning
    assert "a prompt longer than 16" in warning
