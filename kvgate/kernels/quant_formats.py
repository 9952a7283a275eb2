"""GGUF block quantizations kept as stored: their layouts, and dequantization (the specification).

A quantized matrix ``[rows, cols]`` is a uint8 tensor ``[rows, cols / block * bytes_per_block]``:
each row is whole blocks, stored as llama.cpp writes them (little-endian fp16 scales)::

    Q8_0  32 values, 34 bytes   d:f16  q:int8[32]                     x = d q
    Q4_0  32 values, 18 bytes   d:f16  q:u4[32]                       x = d (q - 8)
    Q4_1  32 values, 20 bytes   d:f16  m:f16  q:u4[32]                x = d q + m
    Q4_K 256 values, 144 bytes  d:f16  dmin:f16  scales:u6x16[12]  q:u4[256]
                                8 sub-blocks of 32: x = d sc_j q - dmin m_j
    Q5_K 256 values, 176 bytes  as Q4_K, then qh:u8[32] (the fifth bit), q:u4[256]
    Q6_K 256 values, 210 bytes  ql:u8[128]  qh:u8[64]  scales:int8[16]  d:f16
                                16 sub-blocks of 16: x = d sc_j (q - 32), q 6 bits

4-bit values pack two per byte: in a 32-value group byte ``i`` holds value ``i`` (low nibble)
and value ``i + 16`` (Q4_0/Q4_1) — or, in the K-quants, each 64-value chunk has 32 bytes whose
low nibbles are values 0-31 and high nibbles 32-63 of the chunk.

:func:`dequantize` is the float32 meaning of every format; the kernels (``torch_quant``, the
CPU extension, the Triton GEMMs) are tested against it. Dequantizing is exact in float32 for
Q8_0, Q4_0 and Q4_1 (``d q (+ m)`` of fp16 numbers and small integers); for the K-quants it is
``(d sc) q - (dmin m)``, the products rounded to float32 in that order, as llama.cpp computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class QuantFormat(StrEnum):
    """The block formats kept resident as stored (GGUF type names)."""

    Q8_0 = "Q8_0"
    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q4_K = "Q4_K"
    Q5_K = "Q5_K"
    Q6_K = "Q6_K"


@dataclass(frozen=True)
class BlockLayout:
    values: int  # values per block
    nbytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.values * self.nbytes


LAYOUTS: dict[QuantFormat, BlockLayout] = {
    QuantFormat.Q8_0: BlockLayout(32, 34),
    QuantFormat.Q4_0: BlockLayout(32, 18),
    QuantFormat.Q4_1: BlockLayout(32, 20),
    QuantFormat.Q4_K: BlockLayout(256, 144),
    QuantFormat.Q5_K: BlockLayout(256, 176),
    QuantFormat.Q6_K: BlockLayout(256, 210),
}


def check_quantized(fmt: QuantFormat, data: torch.Tensor, cols: int) -> None:
    """Raise ValueError unless ``data`` is ``[rows, row_bytes(cols)]`` uint8 of ``fmt``."""
    layout = LAYOUTS[fmt]
    if cols % layout.values:
        raise ValueError(f"{fmt} rows hold whole blocks of {layout.values}, not {cols} values")
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"{fmt} data must be a 2-D uint8 tensor, got {data.dtype} {data.dim()}-D")
    if data.shape[1] != layout.row_bytes(cols):
        raise ValueError(
            f"{fmt} rows of {cols} values take {layout.row_bytes(cols)} bytes, got {data.shape[1]}"
        )


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _low_high(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 packed bytes -> 8 six-bit scales and 8 six-bit mins (int32).

    Sub-blocks 0-3: ``scales[j] & 63`` and ``scales[j + 4] & 63``; 4-7: the low nibbles (scale)
    or high nibbles (min) of ``scales[j + 4]``, with the top two bits from ``scales[j - 4]``
    (scale) or ``scales[j]`` (min).
    """
    s = scales.to(torch.int32)
    first_sc, first_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    last_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    last_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([first_sc, last_sc], -1), torch.cat([first_m, last_m], -1)


def block_values(fmt: QuantFormat, data: torch.Tensor, cols: int) -> torch.Tensor:
    """The integer values of every block, ``[rows, cols]`` int32, in value order (Q4_0: 0..15
    before the ``- 8``; K-quants: 0..15 / 0..31 / 0..63 before any offset)."""
    layout = LAYOUTS[fmt]
    blocks = data.reshape(data.shape[0], cols // layout.values, layout.nbytes)
    if fmt is QuantFormat.Q8_0:
        values = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32)
    elif fmt in (QuantFormat.Q4_0, QuantFormat.Q4_1):
        low, high = _low_high(blocks[..., layout.nbytes - 16 :])
        values = torch.cat([low, high], -1)
    elif fmt is QuantFormat.Q4_K:
        low, high = _low_high(blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32))
        values = torch.cat([low, high], -1)  # [.., chunk, 64]
    elif fmt is QuantFormat.Q5_K:
        low, high = _low_high(blocks[..., 48:].reshape(*blocks.shape[:2], 4, 32))
        qh = blocks[..., 16:48].to(torch.int32).unsqueeze(-2)  # [.., 1, 32]
        shift = 2 * torch.arange(4, device=data.device).view(4, 1)
        low = low | (((qh >> shift) & 1) << 4)
        high = high | (((qh >> (shift + 1)) & 1) << 4)
        values = torch.cat([low, high], -1)
    else:  # Q6_K: two halves of 128, each 64 ql bytes and 32 qh bytes
        ql = blocks[..., 0:128].reshape(*blocks.shape[:2], 2, 64).to(torch.int32)
        qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 1, 32).to(torch.int32)
        low = torch.cat([ql & 0x0F, ql >> 4], -1).reshape(*blocks.shape[:2], 2, 4, 32)
        shift = 2 * torch.arange(4, device=data.device).view(4, 1)
        values = low | (((qh >> shift) & 3) << 4)
    return values.reshape(data.shape[0], cols)


def dequantize(fmt: QuantFormat, data: torch.Tensor, cols: int) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8 of ``fmt`` -> float32 ``[rows, cols]`` (the specification)."""
    check_quantized(fmt, data, cols)
    layout = LAYOUTS[fmt]
    rows, nblocks = data.shape[0], cols // layout.values
    blocks = data.reshape(rows, nblocks, layout.nbytes)
    q = block_values(fmt, data, cols).reshape(rows, nblocks, layout.values).float()
    if fmt is QuantFormat.Q8_0:
        values = _f16(blocks, 0) * q
    elif fmt is QuantFormat.Q4_0:
        values = _f16(blocks, 0) * (q - 8)
    elif fmt is QuantFormat.Q4_1:
        values = _f16(blocks, 0) * q + _f16(blocks, 2)
    elif fmt in (QuantFormat.Q4_K, QuantFormat.Q5_K):
        sc, m = k_scales_mins(blocks[..., 4:16])
        scale = (_f16(blocks, 0) * sc.float()).repeat_interleave(32, -1)
        offset = (_f16(blocks, 2) * m.float()).repeat_interleave(32, -1)
        values = scale * q - offset
    else:
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
        scale = (_f16(blocks, 208) * sc).repeat_interleave(16, -1)
        values = scale * (q - 32)
    return values.reshape(rows, cols)


__all__ = [
    "LAYOUTS",
    "BlockLayout",
    "QuantFormat",
    "block_values",
    "check_quantized",
    "dequantize",
    "k_scales_mins",
]
