"""Rotary position embeddings (the Hugging Face "rotate half" convention) with frequency scaling.

``cos``/``sin`` are tabulated per position in fp32 and grown on demand, so a position's rotation
is the same numbers whether it is computed alone or inside a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvgate.gpu_executor.config import RopeScaling, RopeType


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` rotation frequencies after scaling.

    ``linear`` divides every frequency by ``factor``. ``llama3`` keeps high frequencies (short
    wavelengths), divides low ones by ``factor`` and interpolates smoothly in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type is RopeType.LINEAR:
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type is RopeType.LLAMA3:
        old_context = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context / scaling.low_freq_factor
        high_freq_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen < high_freq_wavelen,
            inv_freq,
            torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated),
        )
    return inv_freq.to(torch.float32)


@dataclass(frozen=True)
class Rotation:
    """The rotation of one batch of positions: gathered once per core pass, used by every layer.

    ``sin_signed`` is ``sin`` with its first half negated, so rotate-half is
    ``x * cos + swap_halves(x) * sin_signed``; ``a * -s`` equals ``-(a * s)`` exactly, so this is
    bit for bit the textbook ``x * cos + cat(-x2, x1) * sin`` with one operation less.
    """

    cos: torch.Tensor  # fp32 [n, 1, head_dim]
    sin_signed: torch.Tensor  # fp32 [n, 1, head_dim]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, heads, head_dim]`` rotated by each row's position (in fp32; x's dtype back)."""
        half = x.shape[-1] // 2
        x_float = x.float()
        swapped = torch.cat([x_float[..., half:], x_float[..., :half]], dim=-1)
        return (x_float * self.cos + swapped * self.sin_signed).to(x.dtype)


class RotaryTable:
    """``cos``/``sin`` tables ``[num_positions, head_dim]`` on one device, grown by doubling."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, device: torch.device):
        self._inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        self._cos = torch.empty(0, head_dim, device=device)
        self._sin_signed = torch.empty(0, head_dim, device=device)

    def _grow(self, num_positions: int) -> None:
        size = max(num_positions, 2 * self._cos.shape[0], 256)
        positions = torch.arange(size, dtype=torch.float32, device=self._inv_freq.device)
        angles = torch.outer(positions, self._inv_freq)
        sin = angles.sin()
        self._cos = torch.cat([angles, angles], dim=-1).cos()
        self._sin_signed = torch.cat([-sin, sin], dim=-1)

    def at(self, positions: torch.Tensor, max_position: int) -> Rotation:
        """The rotation of int64 ``positions [n]``; ``max_position`` bounds them (the caller
        knows it without a device sync)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max_position + 1)
        return Rotation(self._cos[positions].unsqueeze(1), self._sin_signed[positions].unsqueeze(1))
