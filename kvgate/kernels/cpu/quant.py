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


# ------------------------------------------------------------------ groups of eight rows

# Formats the rows8 layout holds (blocks of 32), and where each block's quants start in a block.
ROWS8_FORMATS = {QuantFormat.Q8_0: 2, QuantFormat.Q4_0: 2, QuantFormat.Q4_1: 4}


def _rows8_split(fmt: QuantFormat, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the repacked rows [groups, 8, blocks, block bytes], the rows left over, blocks per row)"""
    rows, row_bytes = data.shape
    block_bytes = _block_bytes(fmt)
    blocks = row_bytes // block_bytes
    whole = rows // 8 * 8
    return data[:whole].reshape(rows // 8, 8, blocks, block_bytes), data[whole:], blocks


def _block_bytes(fmt: QuantFormat) -> int:
    return {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20}[fmt]


def repack_rows8(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """GGUF blocks ``[rows, row_bytes]`` -> the same bytes in groups of eight rows (quant.cpp's
    rows8 layout; the rows past the last whole group stay as stored). Per group and block:
    the eight rows' fp16 ``d`` side by side, then (Q4_1) their ``m``, then their quants in
    groups of four bytes, the eight rows' groups side by side."""
    if fmt not in ROWS8_FORMATS:
        raise ValueError(f"the rows8 layout holds {', '.join(ROWS8_FORMATS)}, not {fmt}")
    groups, tail, blocks = _rows8_split(fmt, data)
    start = ROWS8_FORMATS[fmt]
    g = groups.shape[0]
    scales = groups[..., :start].permute(0, 2, 3, 1)  # [G, blocks, start, 8]
    scales = scales.reshape(g, blocks, start // 2, 2, 8).permute(0, 1, 2, 4, 3)  # fp16 per row
    fours = (_block_bytes(fmt) - start) // 4
    quants = groups[..., start:].reshape(g, 8, blocks, fours, 4).permute(0, 2, 3, 1, 4)
    packed = torch.cat(
        [scales.reshape(g, blocks, 8 * start), quants.reshape(g, blocks, 32 * fours)], dim=2
    )
    repacked = packed.reshape(g * 8, data.shape[1])
    return torch.cat([repacked, tail]).contiguous()


def unpack_rows8(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_rows8`: the GGUF blocks as stored."""
    if fmt not in ROWS8_FORMATS:
        raise ValueError(f"the rows8 layout holds {', '.join(ROWS8_FORMATS)}, not {fmt}")
    groups, tail, blocks = _rows8_split(fmt, data)
    start = ROWS8_FORMATS[fmt]
    g = groups.shape[0]
    fours = (_block_bytes(fmt) - start) // 4
    block_group = groups.reshape(g, blocks, 8 * _block_bytes(fmt))
    scales = block_group[..., : 8 * start].reshape(g, blocks, start // 2, 8, 2)
    scales = scales.permute(0, 3, 1, 2, 4).reshape(g, 8, blocks, start)
    quants = block_group[..., 8 * start :].reshape(g, blocks, fours, 8, 4)
    quants = quants.permute(0, 3, 1, 2, 4).reshape(g, 8, blocks, 4 * fours)
    stored = torch.cat([scales, quants], dim=3).reshape(g * 8, data.shape[1])
    return torch.cat([stored, tail]).contiguous()


def quantized_matmul_rows8(
    x: torch.Tensor, fmt: QuantFormat, data: torch.Tensor, cols: int, compiled: bool
) -> torch.Tensor:
    """:func:`quantized_matmul` for weights in the rows8 layout (the same numbers, bit for bit)."""
    if compiled:
        out: torch.Tensor = torch.ops.kvgate_quant.matmul_rows8(
            x.contiguous(), data, FORMAT_INDEX[fmt], cols
        )
        return out
    return quantized_matmul_reference(x, fmt, unpack_rows8(fmt, data), cols)


def rows8_compiled(result: QuantLoadResult) -> bool:
    """Whether the compiled kernel reads the rows8 layout (it needs AVX2 and F16C)."""
    return result.compiled and bool(torch.ops.kvgate_quant.has_rows8())


__all__ = [
    "FORMAT_INDEX",
    "ROWS8_FORMATS",
    "QuantLoadResult",
    "load",
    "loaded",
    "quantized_matmul",
    "quantized_matmul_rows8",
    "repack_rows8",
    "rows8_compiled",
    "unpack_rows8",
]
