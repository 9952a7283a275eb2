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
from kvgate.kernels.quant_formats import QuantFormat, dequantize
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


# From this many rows of x the float-activation product dequantizes W a chunk at a time into
# oneDNN's GEMM (measured, 1 thread, SmolLM2's shapes: the decode kernel's time grows with every
# row, about 2x oneDNN's per row at 8-16 rows; a chunk's dequantization costs a tenth of its GEMM
# at 32 rows).
FLOAT_GEMM_ROWS = 16
# A chunk's float values (1 MB; of 64 KB to 16 MB chunks the fastest at 16-128 rows).
FLOAT_CHUNK_VALUES = 1 << 18


def float_matmul(
    x: torch.Tensor,
    fmt: QuantFormat,
    data: torch.Tensor,
    cols: int,
    compiled: bool,
    *,
    row_by_row: bool = False,
) -> torch.Tensor:
    """float32 ``x [n, cols]`` @ ``W.T`` with ``x`` as it is: the dequantized matrix's product
    within float32 summation error. Compiled: below :data:`FLOAT_GEMM_ROWS` rows (and at any
    count ``row_by_row``, every row computed alone whatever its batch) the kernel's decode
    product, W's blocks converted in the dot; otherwise W dequantized a chunk of rows at a time
    (the kernel's ``dequantize``) and multiplied by oneDNN's GEMM. Not compiled: the whole
    matrix dequantized by torch (a row at a time ``row_by_row``)."""
    if not compiled:
        weight = dequantize(fmt, data, cols)
        if row_by_row:
            rows = [x[i : i + 1] @ weight.T for i in range(x.shape[0])]
            return torch.cat(rows) if rows else x @ weight.T
        return x @ weight.T
    x = x.contiguous()
    index = FORMAT_INDEX[fmt]
    if row_by_row or x.shape[0] < FLOAT_GEMM_ROWS:
        out: torch.Tensor = torch.ops.kvgate_quant.matmul_float(x, data, index, cols)
        return out
    step = max(8, FLOAT_CHUNK_VALUES // cols)
    parts = []
    for start in range(0, data.shape[0], step):
        weight = torch.ops.kvgate_quant.dequantize(data[start : start + step], index, cols, True)
        parts.append(_dense_product(x, weight))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _dense_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``: oneDNN's GEMM on the plain weight where torch has it (about 2x MKL's
    ``mm`` at these shapes on one thread), torch's ``mm`` otherwise."""
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return out
    return x @ weight.T


def compiled_dequantize(
    fmt: QuantFormat, data: torch.Tensor, cols: int, *, vector: bool = True
) -> torch.Tensor:
    """The float32 values :func:`float_matmul`'s kernel multiplies by (its vector path, or its
    scalar one): :func:`kvgate.kernels.quant_formats.dequantize`'s, bit for bit."""
    out: torch.Tensor = torch.ops.kvgate_quant.dequantize(data, FORMAT_INDEX[fmt], cols, vector)
    return out


# ------------------------------------------------------------------ groups of eight rows

# The rows8 layout, per format: a block's fields as (bytes, unit). In a group of eight rows each
# block's fields follow one another, and within a field the eight rows' units of ``unit`` bytes
# sit side by side ([bytes / unit][row][unit]): fp16 scales by two bytes, 6-bit scale bytes by
# one, quants by four (a group of four values, or of eight nibbles).
ROWS8_FIELDS: dict[QuantFormat, tuple[tuple[int, int], ...]] = {
    QuantFormat.Q8_0: ((2, 2), (32, 4)),  # d, qs
    QuantFormat.Q4_0: ((2, 2), (16, 4)),  # d, qs
    QuantFormat.Q4_1: ((2, 2), (2, 2), (16, 4)),  # d, m, qs
    QuantFormat.Q4_K: ((2, 2), (2, 2), (12, 1), (128, 4)),  # d, dmin, scales, qs
    QuantFormat.Q5_K: ((2, 2), (2, 2), (12, 1), (32, 4), (128, 4)),  # d, dmin, scales, qh, qs
    QuantFormat.Q6_K: ((128, 4), (64, 4), (16, 1), (2, 2)),  # ql, qh, scales, d
}
ROWS8_FORMATS = tuple(ROWS8_FIELDS)


def _rows8_check(fmt: QuantFormat) -> tuple[tuple[int, int], ...]:
    if fmt not in ROWS8_FIELDS:
        shown = ", ".join(ROWS8_FORMATS)
        raise ValueError(f"the rows8 layout holds {shown}, not {fmt}")
    return ROWS8_FIELDS[fmt]


def repack_rows8(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """GGUF blocks ``[rows, row_bytes]`` -> the same bytes in groups of eight rows (quant.cpp's
    rows8 layout, :data:`ROWS8_FIELDS`); the rows past the last whole group stay as stored."""
    fields = _rows8_check(fmt)
    block = sum(size for size, _ in fields)
    rows, row_bytes = data.shape
    groups, blocks, whole = rows // 8, row_bytes // block, rows // 8 * 8
    stored = data[:whole].reshape(groups, 8, blocks, block)
    parts, offset = [], 0
    for size, unit in fields:
        field = stored[..., offset : offset + size].reshape(groups, 8, blocks, size // unit, unit)
        parts.append(field.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 8 * size))
        offset += size
    repacked = torch.cat(parts, dim=2).reshape(whole, row_bytes)
    return torch.cat([repacked, data[whole:]]).contiguous()


def unpack_rows8(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_rows8`: the GGUF blocks as stored."""
    fields = _rows8_check(fmt)
    block = sum(size for size, _ in fields)
    rows, row_bytes = data.shape
    groups, blocks, whole = rows // 8, row_bytes // block, rows // 8 * 8
    packed = data[:whole].reshape(groups, blocks, 8 * block)
    parts, offset = [], 0
    for size, unit in fields:
        field = packed[..., 8 * offset : 8 * (offset + size)]
        field = field.reshape(groups, blocks, size // unit, 8, unit).permute(0, 3, 1, 2, 4)
        parts.append(field.reshape(groups, 8, blocks, size))
        offset += size
    stored = torch.cat(parts, dim=3).reshape(whole, row_bytes)
    return torch.cat([stored, data[whole:]]).contiguous()


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
    "ROWS8_FIELDS",
    "ROWS8_FORMATS",
    "QuantLoadResult",
    "compiled_dequantize",
    "float_matmul",
    "load",
    "loaded",
    "quantized_matmul",
    "quantized_matmul_rows8",
    "repack_rows8",
    "rows8_compiled",
    "unpack_rows8",
]
