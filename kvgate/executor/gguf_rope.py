"""RoPE settings a GGUF file holds, as the ``rope_parameters`` of a Hugging Face config.

Most settings are metadata (``{arch}.rope.freq_base``, ``{arch}.rope.scaling.type`` and its
factor). Two are tensors:

- ``rope_freqs.weight`` ``[rotary_dim / 2]``: llama.cpp's converter stores Llama 3's RoPE scaling
  as the divisor of each rotary frequency (1 for short wavelengths, ``factor`` for long ones, a
  smooth ramp between) and drops the four parameters that produced it. :func:`llama3_parameters`
  finds llama3 parameters that reproduce the stored divisors with transformers' formula, and
  refuses a table no llama3 parameters reproduce: serving a Llama 3.1 file without its scaling
  runs every request with wrong rotations;
- ``rope_factors_long`` / ``rope_factors_short`` (Phi-3's LongRoPE): the config's ``long_factor``
  and ``short_factor`` lists, stored as they are.

Only ratios of the llama3 parameters show in the divisors (the two wavelength thresholds
``original / low_freq_factor`` and ``original / high_freq_factor``), so the parameters found are
one member of a family that computes the same rotations; Llama 3's published values
(``low_freq_factor`` 1, ``high_freq_factor`` 4, a power-of-two original context) are tried first,
so a file converted from a published model reads back as that model's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvgate.executor.checkpoint_error import CheckpointError

# Stored divisors are float32 and were computed from float32 frequencies: agreement to 1e-5
# relative is exact agreement at that precision (a wrong parameter moves them by percents).
_RELATIVE_TOLERANCE = 1e-5
_PUBLISHED_LOW_FREQ_FACTOR = 1.0
_PUBLISHED_HIGH_FREQ_FACTOR = 4.0
_POWERS_OF_TWO = tuple(2**k for k in range(25))


@dataclass(frozen=True)
class Llama3Scaling:
    """The parameters of transformers' ``llama3`` RoPE type."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def rope_parameters(self, theta: float) -> dict[str, object]:
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


def wavelengths(rotary_dim: int, theta: float) -> np.ndarray:
    """``2π / inv_freq`` of each rotary pair, in positions (float64)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return 2 * math.pi * theta**exponents


def llama3_divisors(wavelength: np.ndarray, scaling: Llama3Scaling) -> np.ndarray:
    """What each frequency is divided by under ``scaling`` (transformers' llama3 formula)."""
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (original / wavelength - low) / (high - low)
    ramp = 1.0 / ((1.0 - smooth) / scaling.factor + smooth)
    divisors = np.where(wavelength > original / low, scaling.factor, ramp)
    return np.where(wavelength < original / high, 1.0, divisors)


def llama3_parameters(
    divisors: np.ndarray, rotary_dim: int, theta: float, where: str
) -> Llama3Scaling | None:
    """llama3 parameters whose divisors are ``divisors``; None when every divisor is 1 (the file
    scales nothing). Raises CheckpointError when no llama3 parameters reproduce them."""
    stored = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if stored.shape != (rotary_dim // 2,):
        raise CheckpointError(
            f"{where}: rope_freqs.weight has {stored.size} values, the rotary dimension "
            f"{rotary_dim} needs {rotary_dim // 2}"
        )
    if np.allclose(stored, 1.0, rtol=0.0, atol=_RELATIVE_TOLERANCE):
        return None
    wavelength = wavelengths(rotary_dim, theta)
    for candidate in _candidates(stored, wavelength):
        if np.allclose(llama3_divisors(wavelength, candidate), stored, rtol=_RELATIVE_TOLERANCE):
            return candidate
    shown = ", ".join(f"{value:.6g}" for value in stored)
    raise CheckpointError(
        f"{where}: rope_freqs.weight [{shown}] is not the llama3 RoPE scaling of any parameters "
        "at this θ; kvgate serves only RoPE it can state as a config (refusing, rather than "
        "serving the file with other rotations than it was trained with)"
    )


def _candidates(stored: np.ndarray, wavelength: np.ndarray) -> list[Llama3Scaling]:
    """Llama 3's published ramp at each power-of-two context, then a ramp fitted to the stored
    divisors between 1 and ``factor`` (needs two of them: it has two unknowns)."""
    factor = float(stored.max())
    candidates = [
        Llama3Scaling(factor, _PUBLISHED_LOW_FREQ_FACTOR, _PUBLISHED_HIGH_FREQ_FACTOR, original)
        for original in _POWERS_OF_TWO
    ]
    fitted = _fitted_ramp(stored, wavelength, factor)
    return candidates if fitted is None else [*candidates, fitted]


def _fitted_ramp(stored: np.ndarray, wavelength: np.ndarray, factor: float) -> Llama3Scaling | None:
    """With ``low_freq_factor`` 1, a ramp divisor ``r`` at wavelength ``λ`` satisfies
    ``(1/r - 1/f) / (1 - 1/f) = a/λ - b`` where ``a = original / (high - 1)`` and
    ``b = 1 / (high - 1)``: a line in ``1/λ``, fitted by least squares."""
    if factor <= 1.0:
        return None
    on_ramp = (stored > 1.0 + _RELATIVE_TOLERANCE) & (stored < factor * (1 - _RELATIVE_TOLERANCE))
    if on_ramp.sum() < 2:
        return None
    smooth = (1.0 / stored[on_ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelength[on_ramp], smooth, 1)
    b = -intercept
    if b <= 0 or slope <= 0:
        return None
    return Llama3Scaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=float(f"{1.0 + 1.0 / b:.6g}"),
        original_max_position_embeddings=round(slope / b),
    )
