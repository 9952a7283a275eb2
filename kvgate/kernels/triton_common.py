"""Helpers shared by the Triton launchers (imported only when a Triton backend is chosen)."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def require_matching_triton_mode(kernel: object, device: torch.device) -> None:
    """Fail clearly when a kernel's compiled/interpreted mode does not fit the tensors' device.

    Triton decides the mode once, when ``@triton.jit`` runs, from ``TRITON_INTERPRET``.
    """
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "kvgate's Triton kernels were loaded in compiled mode, so they cannot run on CPU "
            "tensors: set TRITON_INTERPRET=1 before the first kernel call of the process"
        )
    if device.type == "cuda" and interpreted:
        raise RuntimeError(
            "kvgate's Triton kernels were loaded under TRITON_INTERPRET, which cannot run CUDA "
            "tensors: unset TRITON_INTERPRET in processes that use the GPU"
        )
