"""``rope_freqs.weight`` (Llama 3's RoPE scaling as llama.cpp's converter stores it) back to
llama3 parameters: the published models' exactly, any other set as one that computes the same
rotations, a table no llama3 parameters give refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgate.executor.config import CheckpointError
from kvgate.executor.gguf_rope import Llama3Scaling, llama3_parameters, wavelengths
from kvgate.executor.rope import inverse_frequencies
from kvgate.executor.rope_config import RopeScaling, RopeType
from tests.real_model.gguf_writer import llama3_rope_divisors


def _stored(head_dim: int, theta: float, scaling: Llama3Scaling) -> np.ndarray:
    """The table the converter writes for a config with these parameters."""
    config = {
        "hidden_size": head_dim,
        "num_attention_heads": 1,
        "rope_parameters": scaling.rope_parameters(theta),
    }
    return llama3_rope_divisors(config)


def _kvgate_frequencies(head_dim: int, theta: float, scaling: Llama3Scaling) -> torch.Tensor:
    return inverse_frequencies(
        head_dim,
        theta,
        RopeScaling(
            rope_type=RopeType.LLAMA3,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        ),
    )


@pytest.mark.parametrize(
    ("head_dim", "scaling"),
    [
        (128, Llama3Scaling(8.0, 1.0, 4.0, 8192)),  # Llama 3.1 8B/70B/405B
        (64, Llama3Scaling(32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B
        (128, Llama3Scaling(32.0, 1.0, 4.0, 8192)),  # Llama 3.2 3B
        (16, Llama3Scaling(8.0, 1.0, 4.0, 16)),  # the tiny test checkpoint's
    ],
)
def test_the_published_parameters_come_back_exactly(head_dim: int, scaling: Llama3Scaling) -> None:
    stored = _stored(head_dim, 500000.0, scaling)
    assert llama3_parameters(stored, head_dim, 500000.0, "m.gguf") == scaling


def test_other_parameters_come_back_as_the_same_rotations() -> None:
    """Only the two thresholds show in the table; the parameters found rotate alike."""
    scaling = Llama3Scaling(6.0, 2.0, 9.0, 3000)
    stored = _stored(128, 500000.0, scaling)
    found = llama3_parameters(stored, 128, 500000.0, "m.gguf")
    assert found is not None and found.factor == 6.0
    assert torch.allclose(
        _kvgate_frequencies(128, 500000.0, found),
        _kvgate_frequencies(128, 500000.0, scaling),
        rtol=1e-6,
        atol=0.0,
    )


def test_a_table_of_ones_scales_nothing() -> None:
    assert llama3_parameters(np.ones(32, np.float32), 64, 500000.0, "m.gguf") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t[::-1].copy(), "not the llama3 RoPE scaling of any parameters"),  # reversed
        (lambda t: t * np.float32(1.01), "not the llama3 RoPE scaling of any parameters"),
        (lambda t: t[:-1], "rope_freqs.weight has 63 values, the rotary dimension 128 needs 64"),
    ],
)
def test_a_table_no_llama3_parameters_give_is_refused(change: object, message: str) -> None:
    stored = _stored(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    with pytest.raises(CheckpointError, match=message):
        llama3_parameters(change(stored), 128, 500000.0, "m.gguf")  # type: ignore[operator]


def test_the_table_is_read_at_the_file_theta() -> None:
    """The same table at another θ puts the thresholds elsewhere: refused, not misread."""
    stored = _stored(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    assert wavelengths(128, 500000.0)[0] == pytest.approx(2 * np.pi)
    with pytest.raises(CheckpointError):
        llama3_parameters(stored, 128, 10000.0, "m.gguf")
