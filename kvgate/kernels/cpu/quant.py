"""The compiled quantized matmul (``quant.cpp``): built once per machine, or the torch reference.

:func:`load` builds ``quant.cpp`` beside ``ops.cpp`` (same flags, same cache rules, same
``KVGATE_CPU_KERNELS=torch`` switch) and registers ``torch.ops.kvgate_quant.matmul``;
:func:`quantized_matmul` runs it, or :func:`kvgate.kernels.torch_quant.quantized_matmul_reference`
where it did not build (the same numbers, bit for bit, much slower).

The instruction set is the compiler's target for this CPU (``-march=native``): AVX-512 VNNI or
AVX-VNNI dot products where the CPU has them, AVX2 otherwise, plain loops without AVX2.
:meth:`QuantLoadResult.log_line` says which, once, when the executor loads a quantized model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvgate.kernels.cpu import DISABLE_ENV, build_library, disabled
from kvgate.kernels.quant_formats import QuantFormat
from kvgate.kernels.torch_quant import quantized_matmul_reference

SOURCE = Path(__file__).with_name("quant.cpp")
# The kernel's format argument: the index in this order (quant.cpp's enum Format).
FORMAT_INDEX = {fmt: index for index, fmt in enumerate(QuantFormat)}


@dataclass(frozen=True)
class QuantLoadResult:
    compiled: bool
    detail: str
    isa: str | None  # the instruction set compiled for; None: not compiled

    def log_line(self) -> str:
        if self.compiled:
            return f"quantized matmul: compiled, {self.isa} ({self.detail})"
        return f"quantized matmul: torch reference, slow ({self.detail})"


def loaded() -> bool:
    return hasattr(torch.ops.kvgate_quant, "matmul")


def load(build_root: Path) -> QuantLoadResult:
    """Build (once) and load ``quant.cpp`` under ``build_root``; never raises for a missing tool."""
    if disabled():
        return QuantLoadResult(False, f"{DISABLE_ENV}=torch", None)
    if not loaded():
        result = build_library(SOURCE, "kvgate_quant", build_root)
        if not result.compiled:
            return QuantLoadResult(False, result.detail, None)
        detail = result.detail
    else:
        detail = "already loaded"
    return QuantLoadResult(True, detail, str(torch.ops.kvgate_quant.isa()))


def quantized_matmul(
    x: torch.Tensor, fmt: QuantFormat, data: torch.Tensor, cols: int, compiled: bool
) -> torch.Tensor:
    """float32 ``x [n, cols]`` @ ``W.T`` -> ``[n, rows]``; the compiled kernel when ``compiled``
    (then it must be loaded), the torch reference otherwise."""
    if compiled:
        out: torch.Tensor = torch.ops.kvgate_quant.matmul(
            x.contiguous(), data, FORMAT_INDEX[fmt], cols
        )
        return out
    return quantized_matmul_reference(x, fmt, data, cols)


__all__ = ["FORMAT_INDEX", "QuantLoadResult", "load", "loaded", "quantized_matmul"]
