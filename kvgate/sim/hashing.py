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


# The same steps unrolled for two and three values (the simulated model's hot path: a
# function call and a loop cost more than the arithmetic). mix2(a, b) == mix(a, b) and
# mix3(a, b, c) == mix(a, b, c) for every input (tests/sim/test_hashing.py).
def mix2(a: int, b: int) -> int:
    h = (0x9E3779B97F4A7C15 ^ (a & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    h ^= h >> 31
    h = (h ^ (b & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


def mix3(a: int, b: int, c: int) -> int:
    h = (0x9E3779B97F4A7C15 ^ (a & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    h ^= h >> 31
    h = (h ^ (b & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    h ^= h >> 31
    h = (h ^ (c & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
