"""The one place that decides which implementation runs a kernel call.

    CUDA tensors                              -> Triton kernels, compiled
    CPU tensors, TRITON_INTERPRET set truthy  -> the same Triton kernels, interpreted (how CI tests
                                                 them)
    CPU tensors otherwise                     -> vectorized torch (``torch_ops``)

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined*, so the Triton modules are imported
only on first use, and a process that sets the variable after that gets a clear error instead of
a compiled kernel handed CPU pointers.
"""

from __future__ import annotations

import os
from enum import StrEnum

import torch

# The spellings Triton itself accepts as true for its boolean environment knobs.
_TRUTHY = frozenset({"1", "true", "on", "yes"})


class Backend(StrEnum):
    TRITON = "triton"
    TORCH = "torch"


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


def select_backend(device: torch.device) -> Backend:
    """Pick the implementation for tensors on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return Backend.TRITON
    if device.type == "cpu":
        return Backend.TRITON if triton_interpreting() else Backend.TORCH
    raise ValueError(f"kvgate kernels run on CUDA or CPU tensors, got device {device}")
