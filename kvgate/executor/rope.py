"""Rotary position embeddings (the Hugging Face "rotate half" convention) with frequency scaling.

``cos``/``sin`` are tabulated per position in fp32 and grown on demand, so a position's rotation
is the same numbers whether it is computed alone or inside a batch. A position's rotation depends
on the position alone, never on the batch, the request or how its prompt was cut: that is what
lets the paged cache, the prefix cache, snapshots, migration and recompute treat a cached key as
a function of (token, position). Two scalings transformers applies per forward call are
therefore made per position here:

- ``longrope`` (Phi-3): transformers rotates a whole call with the long factors when the call's
  last position reaches ``original_max_position_embeddings``. kvgate rotates position ``p`` with
  the long factors when ``p >= original_max_position_embeddings``, else the short ones. That is
  transformers' own result for generation with a KV cache from a prompt that fits the original
  context (each decode step is a call of one position); a prompt longer than the original
  context, which transformers prefills in one call with the long factors throughout, differs in
  its first ``original_max_position_embeddings`` keys.
- ``dynamic`` (NTK): transformers grows θ with the call's length ``L`` past
  ``max_position_embeddings`` ``M``. kvgate rotates position ``p`` with the θ of ``L = p + 1``:
  plain RoPE below ``M`` (as transformers), and transformers' cached-generation result past it
  for a prompt shorter than ``M``. A longer prompt, which transformers rotates in one call with
  the θ of its whole length, differs; so does transformers itself from one call to the next, as
  its rotary module keeps the largest θ it grew to until a call shorter than ``M`` resets it.

``yarn`` and ``longrope`` also scale ``cos`` and ``sin`` by an attention factor (so the scores
by its square), as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvgate.executor.rope_config import RopeScaling, RopeType


def _exponents(head_dim: int) -> torch.Tensor:
    """float64 ``[head_dim // 2]``: ``2i / head_dim``, the power of θ each frequency divides by."""
    return torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` rotation frequencies after scaling, for positions where they do
    not depend on the position (for ``longrope``: the short factors; ``dynamic``: below ``M``).

    ``linear`` divides every frequency by ``factor``. ``llama3`` keeps high frequencies (short
    wavelengths), divides low ones by ``factor`` and interpolates smoothly in between. ``yarn``
    does the same by the number of rotations a frequency makes over the original context,
    between ``beta_slow`` and ``beta_fast``. ``longrope`` divides each frequency by its own factor.
    """
    inv_freq = 1.0 / (theta ** _exponents(head_dim))
    kind = scaling.rope_type
    if kind is RopeType.LINEAR:
        inv_freq = inv_freq / scaling.factor
    elif kind is RopeType.LLAMA3:
        inv_freq = _llama3(inv_freq, scaling)
    elif kind is RopeType.YARN:
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    elif kind is RopeType.LONGROPE:
        inv_freq = inv_freq / _factors(scaling.short_factor, head_dim)
    return inv_freq.to(torch.float32)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(
        wavelen < high_freq_wavelen,
        inv_freq,
        torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated),
    )


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling
) -> torch.Tensor:
    """Frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, with
    a linear ramp over the dimensions in between."""
    context = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:  # the dimension turning ``rotations`` times
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


def _factors(values: tuple[float, ...] | None, head_dim: int) -> torch.Tensor:
    if values is None or len(values) != head_dim // 2:
        count = "none" if values is None else len(values)
        raise ValueError(f"longrope needs {head_dim // 2} factors per list, got {count}")
    return torch.tensor(values, dtype=torch.float64)


def attention_factor(scaling: RopeScaling) -> float:
    """The factor ``cos`` and ``sin`` are multiplied by (1 for types without one)."""
    if scaling.rope_type not in (RopeType.YARN, RopeType.LONGROPE):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type is RopeType.LONGROPE:
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))

    def yarn_scale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_scale(factor, scaling.mscale) / yarn_scale(factor, scaling.mscale_all_dim)
    return yarn_scale(factor)


def rotation_angles(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling
) -> torch.Tensor:
    """fp32 ``[m, head_dim // 2]``: each int64 position times its frequencies (fp32 product)."""
    at = positions.to(torch.float32)
    device = positions.device
    base = inverse_frequencies(head_dim, theta, scaling).to(device)
    angles = torch.outer(at, base)
    kind = scaling.rope_type
    original = scaling.original_max_position_embeddings
    if kind is RopeType.LONGROPE:
        long = 1.0 / (theta ** _exponents(head_dim)) / _factors(scaling.long_factor, head_dim)
        long_angles = torch.outer(at, long.to(torch.float32).to(device))
        angles = torch.where((positions >= original)[:, None], long_angles, angles)
    elif kind is RopeType.DYNAMIC:
        beyond = positions >= original  # p + 1 > M: θ grows with L = p + 1
        if bool(beyond.any()):
            length = (positions[beyond] + 1).to(torch.float64)
            growth = (scaling.factor * length / original - (scaling.factor - 1)) ** (
                head_dim / (head_dim - 2)
            )
            grown = theta * growth  # [b]
            inv = 1.0 / grown[:, None] ** _exponents(head_dim).to(device)[None, :]
            angles[beyond] = at[beyond, None] * inv.to(torch.float32)
    return angles


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
        self._head_dim, self._theta, self._scaling = head_dim, theta, scaling
        self._device = device
        self._attention_factor = attention_factor(scaling)
        self._cos = torch.empty(0, head_dim, device=device)
        self._sin_signed = torch.empty(0, head_dim, device=device)
        inverse_frequencies(head_dim, theta, scaling)  # a bad scaling fails at load, not later

    def _grow(self, num_positions: int) -> None:
        size = max(num_positions, 2 * self._cos.shape[0], 256)
        positions = torch.arange(size, dtype=torch.int64, device=self._device)
        angles = rotation_angles(positions, self._head_dim, self._theta, self._scaling)
        sin = angles.sin()
        cos = torch.cat([angles, angles], dim=-1).cos()
        sin_signed = torch.cat([-sin, sin], dim=-1)
        if self._attention_factor != 1.0:
            cos, sin_signed = cos * self._attention_factor, sin_signed * self._attention_factor
        self._cos, self._sin_signed = cos, sin_signed

    def at(self, positions: torch.Tensor, max_position: int) -> Rotation:
        """The rotation of int64 ``positions [n]``; ``max_position`` bounds them (the caller
        knows it without a device sync)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max_position + 1)
        return Rotation(self._cos[positions].unsqueeze(1), self._sin_signed[positions].unsqueeze(1))
