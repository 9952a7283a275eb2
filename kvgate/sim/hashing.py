"""Deterministic 64-bit mixing for the simulated model (no Python hash randomisation)."""

from __future__ import annotations

import hashlib

_MASK = (1 << 64) - 1


def mix(*values: int) -> int:
    """Fold integers into one well-mixed 64-bit value (a splitmix64-style finaliser per step)."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
