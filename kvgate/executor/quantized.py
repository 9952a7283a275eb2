"""Weights kept in their GGUF block formats: the matrix type, its linear layer and its embedding.

A :class:`QuantizedWeight` is a ``[rows, cols]`` matrix held as stored in the file (uint8 blocks,
:mod:`kvgate.kernels.quant_formats`), possibly as several row segments of different formats:
llama.cpp's mixed files store ``attn_v`` in Q6_K beside Q4_K ``attn_q``/``attn_k``, and the
executor stacks q, k and v into one projection. Stacking never converts; a segment keeps its own
format and the linear runs one product per segment::

    qkv_proj   rows 0 .. Hq D            Q4_K   (q_proj)
               rows Hq D .. (Hq+Hkv) D   Q4_K   (k_proj)   merged with q: same format
               rows (Hq+Hkv) D .. end    Q6_K   (v_proj)   its own segment

Where the product runs:

- CPU: the compiled int8 kernel (``kvgate/kernels/cpu/quant.cpp``), or its torch reference
  where no compiler built it (same numbers, slow). Activations are quantized to int8 per block,
  as llama.cpp does; a row's result never depends on the other rows of its batch, so the
  executor's batch-invariant mode holds with quantized weights too.
- CUDA: Triton's dequantize-in-the-GEMM kernels (``kvgate/kernels/triton_quant.py``): float
  activations, the weights' tiles dequantized in registers.

The embedding looks up rows by dequantizing only the rows asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.kernels.dispatch import Backend, select_backend
from kvgate.kernels.quant_formats import QuantFormat, check_quantized, dequantize

log = logging.getLogger("kvgate.executor")


@dataclass(frozen=True)
class Segment:
    """Consecutive rows of one format: ``data [rows, row_bytes]`` uint8."""

    fmt: QuantFormat
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[rows, cols]`` matrix as row segments of GGUF blocks (see the module docstring)."""

    segments: tuple[Segment, ...]
    cols: int

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a quantized weight has at least one segment")
        for segment in self.segments:
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
        return self.segments[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    @property
    def formats(self) -> tuple[QuantFormat, ...]:
        return tuple(dict.fromkeys(s.fmt for s in self.segments))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix ``[rows, cols]`` (tests and references; never on the serving path)."""
        parts = [dequantize(s.fmt, s.data, self.cols) for s in self.segments]
        return torch.cat(parts).to(dtype)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` (int64), in that order: a row is whole blocks, so it moves as bytes.
        One segment only (the reader permutes tensors before they are stacked)."""
        if len(self.segments) != 1:
            raise ValueError("take_rows works on a single-segment weight")
        segment = self.segments[0]
        return QuantizedWeight.of(segment.fmt, segment.data[index].contiguous(), self.cols)

    def lookup(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``token_ids`` (int64 ``[n]``) dequantized: ``[n, cols]`` (the embedding)."""
        if len(self.segments) != 1:
            raise ValueError("an embedding is one segment")
        segment = self.segments[0]
        return dequantize(segment.fmt, segment.data[token_ids], self.cols).to(dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(
            tuple(Segment(s.fmt, s.data.to(device)) for s in self.segments), self.cols
        )


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
    merged: list[Segment] = []
    for segment in (s for p in quantized for s in p.segments):
        if merged and merged[-1].fmt is segment.fmt:
            merged[-1] = Segment(segment.fmt, torch.cat([merged[-1].data, segment.data]))
        else:
            merged.append(segment)
    return QuantizedWeight(tuple(merged), quantized[0].cols)


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
        return b"".join(s.data.cpu().numpy().tobytes() for s in weight.segments)
    return weight.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


@cache
def prepare_quant_kernel() -> cpu_quant.QuantLoadResult:
    """Build (once per machine) and load the CPU kernel; log which path quantized linears take."""
    from kvgate.executor.gguf_checkpoint import cache_root  # noqa: PLC0415  (no import cycle)

    result = cpu_quant.load(cache_root() / "kernels")
    log.info(result.log_line())
    return result


def segment_matmul(x: torch.Tensor, segment: Segment, cols: int) -> torch.Tensor:
    """``x [n, cols] @ segment.T`` on the tensors' device, in x's dtype."""
    if select_backend(segment.data.device) is Backend.TRITON:
        from kvgate.kernels.triton_quant import gguf_matmul  # noqa: PLC0415  (Triton: on use)

        return gguf_matmul(x, segment.fmt, segment.data, cols)
    out = cpu_quant.quantized_matmul(
        x.float(), segment.fmt, segment.data, cols, prepare_quant_kernel().compiled
    )
    return out.to(x.dtype)


@dataclass(frozen=True)
class QuantizedLinear:
    """``y = x @ W.T + bias`` with ``W`` quantized (one product per segment)."""

    weight: QuantizedWeight
    bias: torch.Tensor | None  # [rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, cols] -> [n, rows]
        outs = [segment_matmul(x, s, self.weight.cols) for s in self.weight.segments]
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
    "DenseEmbedding",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "Segment",
    "Weight",
    "dense",
    "embedding",
    "fingerprint_bytes",
    "prepare_quant_kernel",
    "stack_rows",
    "weight_nbytes",
]
