"""The model's linear layers, with weights in the layout the device's GEMM reads fastest.

``y = x @ weight.T + bias`` two ways:

- ``TORCH``: ``F.linear`` on the checkpoint's ``[out, in]`` weight (the reference; what runs on
  CUDA and for dtypes oneDNN does not pack here);
- ``ONEDNN``: on CPU in float32, the weight is reordered once, at load, into oneDNN's blocked
  layout, and every call runs oneDNN's GEMM on it directly. ``F.linear`` on CPU goes to MKL,
  which reorders (or reads unblocked) the weight on every call.

Measured (SmolLM2-135M shapes, 1 thread, AMD EPYC, loaded machine): oneDNN prepacked vs
``F.linear``: 1.2-1.8x at 32 rows, 2x for the 49,152-row output layer, about even at 1 row;
against vLLM's CPU ``onednn_mm`` on the same weights: equal bit for bit, 1-7 % slower per call.
The results differ from ``F.linear`` in the last bits (a different summation order) and, like
``F.linear``'s, do not depend on the other rows of the batch. The packed copy is kept beside
the checkpoint weight, so on CPU the linear weights take twice their size in memory.

Quantized weights (:class:`~kvgate.executor.quantized.QuantizedWeight`, GGUF blocks kept as
stored) run their own products whatever the backend (``quantized.QuantizedLinear``: the CPU
kernels, Triton on CUDA). A row's result never depends on its batch with int8 activations;
with float32 ones, from 16 rows on it goes through oneDNN's GEMM unless the batch-invariant mode
asks for every row alone.

Rows: oneDNN gives a row the same bits at every row count but one: a single row takes another
kernel (a different summation order; measured for inner dimensions from 1,536 up, e.g. the MLP's
down projection). ``single_row_as_two`` (the executor's batch-invariant mode) runs a lone row
with a copy of itself beside it, so a row's output never depends on the batch it is in, for
4-12 % more time on one-row calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F

from kvgate.executor.quantized import QuantizedLinear, QuantizedWeight, Weight


class LinearBackend(StrEnum):
    TORCH = "torch"
    ONEDNN = "onednn"


def select_linear_backend(device: torch.device, dtype: torch.dtype) -> LinearBackend:
    """oneDNN prepacked weights where torch has them (CPU, float32), ``F.linear`` otherwise."""
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if device.type == "cpu" and dtype == torch.float32 and mkldnn:
        return LinearBackend.ONEDNN
    return LinearBackend.TORCH


@dataclass(frozen=True)
class Linear:
    """One linear layer: the checkpoint weight, and its packed form when the backend packs."""

    weight: Weight  # [out, in]: float, or quantized blocks
    bias: torch.Tensor | None  # [out]
    packed: torch.Tensor | None  # oneDNN's blocked layout of ``weight``; None: use F.linear
    single_row_as_two: bool = False  # packed only: a lone row runs beside a copy of itself
    quantized: QuantizedLinear | None = None  # set when ``weight`` is quantized

    @classmethod
    def build(
        cls,
        weight: Weight,
        bias: torch.Tensor | None,
        backend: LinearBackend,
        *,
        batch_invariant: bool = False,
    ) -> Linear:
        if isinstance(weight, QuantizedWeight):
            quantized = QuantizedLinear(weight, bias, row_by_row=batch_invariant)
            return cls(weight, bias, None, quantized=quantized)
        if backend is LinearBackend.TORCH:
            if batch_invariant:
                raise ValueError("batch-invariant linears need oneDNN's packed weights (CPU fp32)")
            return cls(weight, bias, None)
        # No batch-size hint: the default blocking was as fast as any hint at 1, 32 and 512 rows.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        return cls(weight, bias, packed, single_row_as_two=batch_invariant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.quantized is not None:
            return self.quantized(x)
        if self.packed is None:
            assert isinstance(self.weight, torch.Tensor)  # quantized ones returned above
            return F.linear(x, self.weight, self.bias)
        if self.single_row_as_two and x.shape[0] == 1:
            pair = x.expand(2, x.shape[1]).contiguous()
            return self._packed_call(pair)[:1]
        return self._packed_call(x.contiguous())

    def _packed_call(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out
