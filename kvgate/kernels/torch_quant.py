"""The int8 path of a quantized matmul, in plain torch: the specification of the CPU kernels.

``y = x @ W.T`` with ``W`` in a block format (:mod:`kvgate.kernels.quant_formats`) never turns
``W`` into floats. As llama.cpp's CPU backend does, each row of ``x`` is quantized per block to
int8, the products of a block are summed exactly in integers, and only one float term per
block (per row of ``x`` and row of ``W``) is added up::

    activations  a = da qa, per block of 32 (Q8_0, Q4_0, Q4_1 weights) or 256 (K-quants):
                 da = max|x| / 127, qa = rint(x / da) (ties to even), |qa| <= 127
    per block    Q8_0, Q4_0   term = (dw da) f(sum qw qa)               (Q4_0: qw - 8)
                 Q4_1         term = (dw da) f(sum qw qa) + mw sa       sa = da f(sum qa)
                 Q4_K, Q5_K   term = (d da) f(sum_j sc_j sum qw qa) - (dmin da) f(sum_j m_j sum qa)
                 Q6_K         term = (d da) f(sum_j sc_j sum (qw - 32) qa)
    a row        y = ((term_0 + term_1) + term_2) + ...    (float32, block order)

``f`` is the int32 -> float32 conversion (round to nearest even), every product and sum is one
float32 operation in the order written (no fused multiply-add). The compiled kernel follows
these steps exactly, so its output equals this function's bit for bit, at any number of rows
and threads: a row's result never depends on the other rows of the batch.

Against the float32 product with the dequantized weights, the int8 activations cost accuracy:
measured relative RMS error about 0.3-0.6 % (tests/kernels/test_kernels_quant.py states the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.kernels.quant_formats import (
    LAYOUTS,
    QuantFormat,
    block_values,
    check_quantized,
    k_scales_mins,
)

K_QUANTS = frozenset({QuantFormat.Q4_K, QuantFormat.Q5_K, QuantFormat.Q6_K})


def activation_block(fmt: QuantFormat) -> int:
    """Values per activation scale: 256 for the K-quants (one per super-block), else 32."""
    return 256 if fmt in K_QUANTS else 32


@dataclass(frozen=True)
class QuantizedActivations:
    q: torch.Tensor  # [n, k] int8, |q| <= 127
    d: torch.Tensor  # [n, k / block] float32 scales
    sums: torch.Tensor  # [n, k / 16] int32: sum of q per 16 values

    def block_sums(self, width: int) -> torch.Tensor:
        """int64 ``[n, k / width]``: sum of q per ``width`` values (a multiple of 16)."""
        n = self.sums.shape[0]
        return self.sums.reshape(n, -1, width // 16).sum(-1, dtype=torch.int64)


def quantize_activations(x: torch.Tensor, block: int) -> QuantizedActivations:
    """float32 ``[n, k]`` -> int8 per block of ``block`` values (see the module docstring)."""
    n, k = x.shape
    blocks = x.reshape(n, k // block, block)
    amax = blocks.abs().amax(-1)
    d = amax / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    sums = q.reshape(n, k // 16, 16).sum(-1, dtype=torch.int32)
    return QuantizedActivations(q.reshape(n, k), d, sums)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float().squeeze(-1)


def _dots(qa: torch.Tensor, qw: torch.Tensor, width: int) -> torch.Tensor:
    """int64 ``[n, rows, k / width]``: exact sums of ``qa * qw`` per ``width`` values.

    float64 holds every product and partial sum here exactly (|sum| < 2**31)."""
    n, rows = qa.shape[0], qw.shape[0]
    a = qa.double().reshape(n, -1, width)
    w = qw.double().reshape(rows, -1, width)
    return torch.einsum("nbv,rbv->nrb", a, w).round().to(torch.int64)


def block_terms(x: torch.Tensor, fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, rows, blocks]``: each block's term (the module docstring's table)."""
    n, cols = x.shape
    layout = LAYOUTS[fmt]
    acts = quantize_activations(x.float().contiguous(), activation_block(fmt))
    blocks = data.reshape(data.shape[0], cols // layout.values, layout.nbytes)
    qw = block_values(fmt, data, cols)
    da = acts.d.unsqueeze(1)  # [n, 1, blocks]

    def f(integer: torch.Tensor) -> torch.Tensor:
        return integer.to(torch.int32).to(torch.float32)

    if fmt in (QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1):
        centred = qw - 8 if fmt is QuantFormat.Q4_0 else qw
        term = (_f16(blocks, 0) * da) * f(_dots(acts.q, centred, 32))
        if fmt is QuantFormat.Q4_1:
            sa = acts.d * f(acts.block_sums(32))
            term = term + _f16(blocks, 2) * sa.unsqueeze(1)
        return term
    if fmt is QuantFormat.Q6_K:
        sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.int64)  # [rows, b, 16]
        dots = _dots(acts.q, qw - 32, 16).reshape(n, *sc.shape)
        return (_f16(blocks, 208) * da) * f((dots * sc).sum(-1))
    sc, m = k_scales_mins(blocks[..., 4:16])  # [rows, b, 8]
    dots = _dots(acts.q, qw, 32).reshape(n, *sc.shape)
    sums = acts.block_sums(32).reshape(n, 1, -1, 8)
    isum = (dots * sc.to(torch.int64)).sum(-1)
    imin = (sums * m.to(torch.int64)).sum(-1)
    return (_f16(blocks, 0) * da) * f(isum) - (_f16(blocks, 2) * da) * f(imin)


def quantized_matmul_reference(
    x: torch.Tensor, fmt: QuantFormat, data: torch.Tensor, cols: int
) -> torch.Tensor:
    """float32 ``x [n, cols]`` times ``W.T`` (``W [rows, cols]`` as ``data``) -> ``[n, rows]``."""
    check_quantized(fmt, data, cols)
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [n, {cols}], got {tuple(x.shape)}")
    terms = block_terms(x, fmt, data)
    out = torch.zeros(terms.shape[:2], dtype=torch.float32)
    for b in range(terms.shape[2]):  # block order, one rounding per addition
        out = out + terms[:, :, b]
    return out


__all__ = [
    "K_QUANTS",
    "QuantizedActivations",
    "activation_block",
    "block_terms",
    "quantize_activations",
    "quantized_matmul_reference",
]
