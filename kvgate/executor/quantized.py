"""Weights kept in their quantized formats: the matrix type, its linear layer and its embedding.

A :class:`QuantizedWeight` is a ``[rows, cols]`` matrix held as stored in the file, as row
segments: GGUF blocks (:class:`Segment`, uint8 blocks, :mod:`kvgate.kernels.quant_formats`) or
one AWQ, GPTQ or FP8 projection's tensors (:class:`PackedSegment`,
:mod:`kvgate.kernels.torch_weight_only`). A GGUF weight may have several segments of different
formats:
llama.cpp's mixed files store ``attn_v`` in Q6_K beside Q4_K ``attn_q``/``attn_k``, and the
executor stacks q, k and v into one projection. Stacking never converts; a segment keeps its own
format and the linear runs one product per segment::

    qkv_proj   rows 0 .. Hq D            Q4_K   (q_proj)
               rows Hq D .. (Hq+Hkv) D   Q4_K   (k_proj)   merged with q: same format
               rows (Hq+Hkv) D .. end    Q6_K   (v_proj)   its own segment

Where the product runs:

- CPU: the compiled kernels (``kvgate/kernels/cpu/quant.cpp``), or their torch references
  where no compiler built them, with the activations as the segment says
  (:class:`~kvgate.protocol.enums.QuantActivations`): float32 (each block dequantized in the dot
  product; the default) or int8 per block, as llama.cpp does (the faster; its rows8 layout).
  The int8 product of a row never depends on the other rows of its batch, so the executor's
  batch-invariant mode holds with int8 activations; the float32 product of a few rows runs row
  by row too, and from 16 rows on through oneDNN's GEMM (unless the mode asks for every row alone).
- CUDA: Triton's dequantize-in-the-GEMM kernels (``kvgate/kernels/triton_quant.py``): float
  activations, the weights' tiles dequantized in registers. AWQ, GPTQ and FP8 segments run only
  there (or under the Triton interpreter); on CPU the loader dequantizes them when it reads them
  (``weights.read_checkpoint``), as no CPU kernel reads their layouts.

The embedding looks up rows by dequantizing only the rows asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from kvgate.executor.weight_only import WeightOnlyMethod
from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.kernels.quant_formats import QuantFormat, check_quantized, dequantize
from kvgate.kernels.torch_weight_only import awq_dequantize, fp8_dequantize, gptq_dequantize
from kvgate.protocol.enums import QuantActivations

log = logging.getLogger("kvgate.executor")


@dataclass(frozen=True)
class Segment:
    """Consecutive rows of one format: ``data [rows, row_bytes]`` uint8, as stored, or (``rows8``,
    CPU only, int8 activations only) the same bytes in groups of eight rows for the CPU kernel
    (:func:`kvgate.kernels.cpu.quant.repack_rows8`). ``activations``: how the CPU product
    treats the activations (CUDA multiplies in their own dtype whatever it says)."""

    fmt: QuantFormat
    data: torch.Tensor
    rows8: bool = False
    activations: QuantActivations = QuantActivations.INT8

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def stored(self) -> Segment:
        """The blocks in the file's order (what everything but the CPU kernel reads)."""
        if not self.rows8:
            return self
        return Segment(self.fmt, cpu_quant.unpack_rows8(self.fmt, self.data))

    def repacked(self) -> Segment:
        """In the rows8 layout where the format has one and there is a group of eight rows
        (the int8 kernel's layout: a float-activation segment stays as stored)."""
        if (
            self.rows8
            or self.activations is not QuantActivations.INT8
            or self.fmt not in cpu_quant.ROWS8_FORMATS
            or self.rows < 8
        ):
            return self
        return Segment(self.fmt, cpu_quant.repack_rows8(self.fmt, self.data), rows8=True)

    def with_activations(self, activations: QuantActivations) -> Segment:
        """The same blocks, multiplied with ``activations`` (as stored: no layout change)."""
        return Segment(self.fmt, self.stored().data, activations=activations)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.stored().data,)

    def to(self, device: torch.device) -> Segment:
        if device.type == "cpu":
            return replace(self, data=self.data.to(device))
        return Segment(self.fmt, self.stored().data.to(device))

    def dequantize(self, cols: int) -> torch.Tensor:
        return dequantize(self.fmt, self.stored().data, cols)

    def row_blocks(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (int64) as stored blocks ``[len(index), row_bytes]``."""
        if not self.rows8:
            return self.data[index]
        whole = self.rows // 8 * 8
        groups = self.data[:whole].reshape(whole // 8, -1)
        in_group = index.clamp(max=max(whole - 1, 0))
        unpacked = cpu_quant.unpack_rows8(
            self.fmt, groups[in_group // 8].reshape(-1, self.data.shape[1])
        )
        picked = unpacked.reshape(len(index), 8, -1)[torch.arange(len(index)), in_group % 8]
        return torch.where((index < whole).unsqueeze(1), picked, self.data[index])


@dataclass(frozen=True)
class PackedSegment:
    """One AWQ, GPTQ or FP8 projection ``[rows, cols]`` as its checkpoint stores it::

        AWQ   packed = qweight int32 [cols, rows/8], zeros = qzeros, scales [groups, rows]
        GPTQ  packed = qweight int32 [cols*bits/32, rows], zeros = qzeros, scales, g_idx [cols]
        FP8   packed = weight float8_e4m3fn [rows, cols], scales float32 [1] or [rows]

    (layouts: :mod:`kvgate.kernels.torch_weight_only`). Never merged with a neighbour: each
    projection has its own groups (and, with GPTQ's act-order, its own ``g_idx``).
    """

    method: WeightOnlyMethod
    rows: int
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    bits: int = 8
    group_size: int = 0  # AWQ/GPTQ: inputs per group (the number of inputs for one group)

    @property
    def fmt(self) -> str:
        if self.method is WeightOnlyMethod.FP8:
            return "FP8 e4m3"
        return f"{self.method.upper()} int{self.bits}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        optional = (self.zeros, self.g_idx)
        return (self.packed, self.scales, *(t for t in optional if t is not None))

    def to(self, device: torch.device) -> PackedSegment:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            packed=self.packed.to(device),
            scales=self.scales.to(device),
            zeros=move(self.zeros),
            g_idx=move(self.g_idx),
        )

    def dequantize(self, cols: int) -> torch.Tensor:
        """The float32 ``[rows, cols]`` matrix (the specification the kernels are tested on)."""
        del cols  # the stored shapes say it
        if self.method is WeightOnlyMethod.FP8:
            return fp8_dequantize(self.packed, self.scales)
        assert self.zeros is not None
        if self.method is WeightOnlyMethod.AWQ:
            return awq_dequantize(self.packed, self.zeros, self.scales, self.group_size)
        return gptq_dequantize(
            self.packed, self.zeros, self.scales, self.g_idx, self.bits, self.group_size
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, cols] @ W.T`` in x's dtype: Triton's kernel where it runs; elsewhere the
        dequantized matrix (correct, and slow: the loader keeps these quantized only where
        Triton runs)."""
        if select_backend(self.packed.device) is not Backend.TRITON:
            return x @ self.dequantize(x.shape[1]).to(x.dtype).T
        from kvgate.kernels import triton_quant  # noqa: PLC0415  (Triton: on use)

        if self.method is WeightOnlyMethod.FP8:
            return triton_quant.fp8_matmul(x, self.packed, self.scales)
        assert self.zeros is not None
        if self.method is WeightOnlyMethod.AWQ:
            return triton_quant.awq_matmul(x, self.packed, self.zeros, self.scales, self.group_size)
        return triton_quant.gptq_matmul(
            x, self.packed, self.zeros, self.scales, self.g_idx, self.bits, self.group_size
        )


AnySegment = Segment | PackedSegment


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[rows, cols]`` matrix as row segments (see the module docstring)."""

    segments: tuple[AnySegment, ...]
    cols: int

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a quantized weight has at least one segment")
        for segment in self.segments:
            if isinstance(segment, Segment):
                check_quantized(segment.fmt, segment.data, self.cols)

    @classmethod
    def of(cls, fmt: QuantFormat, data: torch.Tensor, cols: int) -> QuantizedWeight:
        return cls((Segment(fmt, data),), cols)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return self.segments[0].tensors()[0].device

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(str(s.fmt) for s in self.segments))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix ``[rows, cols]`` (tests and references; never on the serving path)."""
        parts = [s.dequantize(self.cols) for s in self.segments]
        return torch.cat(parts).to(dtype)

    def _gguf(self, what: str) -> Segment:
        if len(self.segments) != 1 or not isinstance(self.segments[0], Segment):
            raise ValueError(f"{what} works on a single-segment GGUF weight")
        return self.segments[0]

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` (int64), in that order: a row is whole blocks, so it moves as bytes.
        One segment only (the reader permutes tensors before they are stacked)."""
        segment = self._gguf("take_rows")
        return QuantizedWeight.of(segment.fmt, segment.row_blocks(index).contiguous(), self.cols)

    def lookup(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``token_ids`` (int64 ``[n]``) dequantized: ``[n, cols]`` (the embedding)."""
        segment = self._gguf("an embedding")
        return dequantize(segment.fmt, segment.row_blocks(token_ids), self.cols).to(dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(tuple(s.to(device) for s in self.segments), self.cols)


Weight = torch.Tensor | QuantizedWeight


def stack_rows(parts: Sequence[Weight]) -> Weight:
    """``parts`` stacked along dim 0: ``torch.cat`` for float tensors; for quantized ones the
    segments side by side, neighbours of one format merged into one (never converted)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        raise ValueError("cannot stack quantized and float weights into one projection")
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len({p.cols for p in quantized}) != 1:
        raise ValueError("stacked weights must have the same number of columns")
    merged: list[AnySegment] = []
    for segment in (s for p in quantized for s in p.segments):
        last = merged[-1] if merged else None
        if isinstance(last, Segment) and isinstance(segment, Segment) and last.fmt is segment.fmt:
            merged[-1] = Segment(
                segment.fmt, torch.cat([last.stored().data, segment.stored().data])
            )
        else:
            merged.append(segment)
    return QuantizedWeight(tuple(merged), quantized[0].cols)


def repacked_rows8(weight: Weight) -> Weight:
    """``weight`` with its GGUF segments in the CPU kernel's rows8 layout (segments of eight rows
    or more): the same bytes, reordered, so the same memory."""
    if not isinstance(weight, QuantizedWeight):
        return weight
    segments = tuple(s.repacked() if isinstance(s, Segment) else s for s in weight.segments)
    return QuantizedWeight(segments, weight.cols)


def with_activations(weight: Weight, activations: QuantActivations) -> Weight:
    """``weight``'s GGUF segments multiplied with ``activations`` on CPU (stored layout)."""
    if not isinstance(weight, QuantizedWeight):
        return weight
    segments = tuple(
        s.with_activations(activations) if isinstance(s, Segment) else s for s in weight.segments
    )
    return QuantizedWeight(segments, weight.cols)


def dense(weight: Weight) -> torch.Tensor:
    """``weight`` where only a float tensor will do (norms, biases, experts): a ValueError
    naming the formats for a quantized one."""
    if isinstance(weight, QuantizedWeight):
        formats = ", ".join(weight.formats)
        raise ValueError(
            f"a {weight.shape} weight in {formats} is used where kvgate runs float weights only "
            "(--dtype float32 dequantizes the model)"
        )
    return weight


def weight_nbytes(weight: Weight) -> int:
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def fingerprint_bytes(weight: Weight) -> bytes:
    """The bytes that identify a weight (what a migration compares): a quantized weight's
    blocks, a float tensor's values."""
    if isinstance(weight, QuantizedWeight):
        return b"".join(_raw_bytes(t) for s in weight.segments for t in s.tensors())
    return _raw_bytes(weight)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy())


@cache
def prepare_quant_kernel() -> cpu_quant.QuantLoadResult:
    """Build (once per machine) and load the CPU kernel; log which path quantized linears take."""
    from kvgate.executor.gguf_checkpoint import cache_root  # noqa: PLC0415  (no import cycle)

    result = cpu_quant.load(cache_root() / "kernels")
    log.info(result.log_line())
    return result


def segment_matmul(
    x: torch.Tensor, segment: AnySegment, cols: int, *, row_by_row: bool = False
) -> torch.Tensor:
    """``x [n, cols] @ segment.T`` on the tensors' device, in x's dtype. ``row_by_row``: a
    float-activation CPU product computes every row alone (the batch-invariant mode; the int8
    products always do)."""
    if isinstance(segment, PackedSegment):
        return segment.matmul(x)
    # A rows8 segment is CPU-only and read by quant.cpp alone, whatever the Triton mode.
    if not segment.rows8 and select_backend(segment.data.device) is Backend.TRITON:
        from kvgate.kernels.triton_quant import gguf_matmul  # noqa: PLC0415  (Triton: on use)

        return gguf_matmul(x, segment.fmt, segment.data, cols)
    compiled = prepare_quant_kernel().compiled
    if segment.activations is QuantActivations.FLOAT32:
        out = cpu_quant.float_matmul(
            x.float(), segment.fmt, segment.data, cols, compiled, row_by_row=row_by_row
        )
        return out.to(x.dtype)
    multiply = cpu_quant.quantized_matmul_rows8 if segment.rows8 else cpu_quant.quantized_matmul
    out = multiply(x.float(), segment.fmt, segment.data, cols, compiled)
    return out.to(x.dtype)


@dataclass(frozen=True)
class QuantizedLinear:
    """``y = x @ W.T + bias`` with ``W`` quantized (one product per segment); ``row_by_row``:
    every row's output independent of its batch (see :func:`segment_matmul`)."""

    weight: QuantizedWeight
    bias: torch.Tensor | None  # [rows]
    row_by_row: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, cols] -> [n, rows]
        cols = self.weight.cols
        outs = [
            segment_matmul(x, s, cols, row_by_row=self.row_by_row) for s in self.weight.segments
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class QuantizedEmbedding:
    """int64 ``[n]`` -> ``[n, H]``: the rows asked for, dequantized."""

    weight: QuantizedWeight
    dtype: torch.dtype

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.lookup(token_ids, self.dtype)


@dataclass(frozen=True)
class DenseEmbedding:
    weight: torch.Tensor  # [V, H]

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


def embedding(weight: Weight, dtype: torch.dtype) -> QuantizedEmbedding | DenseEmbedding:
    """The embedding lookup of ``weight`` (``dtype``: the activations' dtype)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedEmbedding(weight, dtype)
    return DenseEmbedding(weight)


__all__ = [
    "AnySegment",
    "DenseEmbedding",
    "PackedSegment",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "Segment",
    "Weight",
    "dense",
    "embedding",
    "fingerprint_bytes",
    "prepare_quant_kernel",
    "repacked_rows8",
    "stack_rows",
    "weight_nbytes",
    "with_activations",
]
