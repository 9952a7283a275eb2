# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (@triton.jit kernels cannot carry Python annotations: Triton reads them as kernel types.)
"""Triton GEMMs that dequantize the weights in the GEMM: GGUF blocks, AWQ, GPTQ and FP8.

``out [M, N] = x [M, K] @ W.T`` where ``W [N, K]`` never exists in memory as floats: each
program owns a ``BLOCK_M x BLOCK_N`` tile of ``out`` and, for every ``BLOCK_K`` step, rebuilds
the ``[BLOCK_K, BLOCK_N]`` tile of ``W.T`` it needs from the stored bits in registers, then
multiplies it with ``tl.dot`` (float32 accumulation)::

    for k0 in 0, BLOCK_K, ...:
        x_tile = x[m0:m0+BM, k0:k0+BK]                     (the activations' dtype)
        w_tile = dequantize(stored bits of W[n0:n0+BN, k0:k0+BK]).T
        acc   += x_tile @ w_tile

The formats (``FORMAT``, a compile-time constant, so each is its own kernel):

    0-5  GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: uint8 blocks as stored
         (:mod:`kvgate.kernels.quant_formats`); every value decoded from its byte(s), its
         block's fp16 scale(s) and, for the K-quants, its sub-block's 6- or 8-bit scale
    6    AWQ int4 (GEMM layout), 7 GPTQ int4/int8 (v1 zero points, act-order ``g_idx``),
    8    FP8 e4m3 with a per-tensor or per-channel scale (decoded from its bits: the same code
         runs under the interpreter, which has no fp8 arithmetic)
         (:mod:`kvgate.kernels.torch_weight_only` is their specification)

The specification of all of them is "dequantize, then multiply": the tests compare with
``x @ dequantize(W).T`` under the Triton interpreter (tests/kernels/test_kernels_triton_quant.py).
Unsupported formats are refused by name before any launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvgate.kernels.quant_formats import QuantFormat, check_quantized
from kvgate.kernels.triton_common import require_matching_triton_mode

__all__ = [
    "QuantGemmConfig",
    "awq_matmul",
    "fp8_matmul",
    "gguf_matmul",
    "gptq_matmul",
]

_GGUF_CODES = {fmt: index for index, fmt in enumerate(QuantFormat)}
_AWQ, _GPTQ, _FP8 = 6, 7, 8


@dataclass(frozen=True)
class QuantGemmConfig:
    block_m: int = 16
    block_n: int = 32
    block_k: int = 32  # any power of two: every element finds its own block and group
    num_warps: int = 4
    num_stages: int | None = None  # software pipelining depth; None: Triton's default

    @classmethod
    def for_rows(cls, m: int, dtype: torch.dtype) -> QuantGemmConfig:
        """The tiling for ``m`` rows of 16-bit activations, from the sweep on an H200
        (``benchmarks/bench_quant_kernels.py --sweep``, docs/benchmarks.md): few rows take
        longer K steps, pipelined (1.4-1.5x the plain 16x32x32 tile at M 1-16); many rows
        take 128x64 tiles on 8 warps (4.5x at M 256, 16x at M 1024). float32 (IEEE dots, and
        the Triton interpreter) keeps the plain tile."""
        if dtype == torch.float32:
            return cls()
        if m <= 16:
            return cls(block_k=64, num_stages=3)
        if m < 128:
            return cls(block_m=64, block_n=64, block_k=64, num_stages=3)
        return cls(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3)


@triton.jit
def _f16_at(ptr, offset, mask):
    """The little-endian fp16 at byte ``offset`` (any shape), as float32."""
    lo = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _gguf_tile(w_ptr, k, n, mask, row_bytes, FORMAT: tl.constexpr):
    """W.T[k, n] of a GGUF matrix, float32 (k [BK, 1], n [1, BN]: broadcast)."""
    row = n.to(tl.int64) * row_bytes
    if FORMAT == 0:  # Q8_0
        base = row + (k // 32) * 34
        q = tl.load(w_ptr + base + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        return _f16_at(w_ptr, base, mask) * q.to(tl.float32)
    elif FORMAT == 1 or FORMAT == 2:  # noqa: PLR1714 (Q4_0, Q4_1; Triton compares constexprs)
        block_bytes: tl.constexpr = 18 if FORMAT == 1 else 20
        base = row + (k // 32) * block_bytes
        i = k % 32
        packed = _byte(w_ptr, base + (block_bytes - 16) + i % 16, mask)
        q = tl.where(i < 16, packed & 15, packed >> 4).to(tl.float32)
        if FORMAT == 1:
            return _f16_at(w_ptr, base, mask) * (q - 8.0)
        else:
            return _f16_at(w_ptr, base, mask) * q + _f16_at(w_ptr, base + 2, mask)
    elif FORMAT == 3 or FORMAT == 4:  # noqa: PLR1714 (Q4_K, Q5_K)
        super_bytes: tl.constexpr = 144 if FORMAT == 3 else 176
        qs: tl.constexpr = 16 if FORMAT == 3 else 48
        base = row + (k // 256) * super_bytes
        i = k % 256
        chunk, r = i // 64, i % 64
        packed = _byte(w_ptr, base + qs + 32 * chunk + r % 32, mask)
        q = tl.where(r < 32, packed & 15, packed >> 4)
        if FORMAT == 4:
            high = _byte(w_ptr, base + 16 + r % 32, mask)
            q = q | (((high >> (2 * chunk + r // 32)) & 1) << 4)
        j = i // 32  # the sub-block: quant_formats.k_scales_mins
        low = j < 4
        s_j = _byte(w_ptr, base + 4 + j, mask)
        s_j4 = _byte(w_ptr, base + 8 + j, mask)
        s_jm4 = _byte(w_ptr, base + 4 + tl.where(low, j, j - 4), mask)
        sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4)).to(tl.float32)
        mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4)).to(tl.float32)
        d = _f16_at(w_ptr, base, mask)
        dmin = _f16_at(w_ptr, base + 2, mask)
        return (d * sc) * q.to(tl.float32) - dmin * mn
    else:  # Q6_K
        base = row + (k // 256) * 210
        i = k % 256
        half, group, lane = i // 128, (i % 128) // 32, i % 32
        packed = _byte(w_ptr, base + 64 * half + (group % 2) * 32 + lane, mask)
        low = tl.where(group < 2, packed & 15, packed >> 4)
        high = (_byte(w_ptr, base + 128 + 32 * half + lane, mask) >> (2 * group)) & 3
        q = (low | (high << 4)).to(tl.float32) - 32.0
        sc = tl.load(w_ptr + base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        return (_f16_at(w_ptr, base + 208, mask) * sc.to(tl.float32)) * q


@triton.jit
def _e4m3(bits):
    """float8 e4m3fn bits (int32 0..255) -> float32 (NaN patterns are not produced by writers)."""
    sign = tl.where((bits & 128) != 0, -1.0, 1.0)
    exponent = (bits >> 3) & 15
    mantissa = (bits & 7).to(tl.float32)
    normal = (1.0 + mantissa / 8.0) * tl.exp2((exponent - 7).to(tl.float32))
    subnormal = mantissa / 8.0 * 0.015625  # 2 ** -6
    return sign * tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _weight_only_tile(w_ptr, s_ptr, z_ptr, g_ptr, k, n, mask, N, K, group_size, scale_stride,
                      FORMAT: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """W.T[k, n] of an AWQ, GPTQ or FP8 weight, float32."""
    if FORMAT == 6:  # AWQ: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]
        shift = 4 * ((n % 8) % 2 * 4 + (n % 8) // 2)
        q = (tl.load(w_ptr + k * (N // 8) + n // 8, mask=mask, other=0) >> shift) & 15
        g = k // group_size
        z = (tl.load(z_ptr + g * (N // 8) + n // 8, mask=mask, other=0) >> shift) & 15
        s = tl.load(s_ptr + g * N + n, mask=mask, other=0).to(tl.float32)
        return (q - z).to(tl.float32) * s
    elif FORMAT == 7:  # GPTQ: qweight [K*BITS/32, N], qzeros [G', N*BITS/32], g_idx [K]
        per: tl.constexpr = 32 // BITS
        field: tl.constexpr = (1 << BITS) - 1
        q = (tl.load(w_ptr + (k // per) * N + n, mask=mask, other=0) >> ((k % per) * BITS)) & field
        g = tl.load(g_ptr + k, mask=k < K, other=0)
        packed_zero = tl.load(z_ptr + g * (N // per) + n // per, mask=mask, other=0)
        z = ((packed_zero >> ((n % per) * BITS)) & field) + 1
        s = tl.load(s_ptr + g * N + n, mask=mask, other=0).to(tl.float32)
        return (q - z).to(tl.float32) * s
    else:  # FP8 e4m3: weight bytes [N, K]; scale [1] (stride 0) or [N]
        bits = tl.load(w_ptr + n.to(tl.int64) * K + k, mask=mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + n * scale_stride, mask=n < N, other=0).to(tl.float32)
        return _e4m3(bits) * s


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K], rows at stride_xm
    w_ptr,  # the stored weight (bytes or int32, see FORMAT)
    s_ptr, z_ptr, g_ptr,  # scales, zero points, group index (weight-only formats; else unused)
    out_ptr,  # [M, N] contiguous, x's dtype
    M, N, K, stride_xm, row_bytes, group_size, scale_stride,
    FORMAT: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        k = offs_k[:, None]
        n = offs_n[None, :]
        w_mask = (k < K) & (n < N)
        if FORMAT < 6:
            w = _gguf_tile(w_ptr, k, n, w_mask, row_bytes, FORMAT)
        else:
            w = _weight_only_tile(
                w_ptr, s_ptr, z_ptr, g_ptr, k, n, w_mask, N, K, group_size, scale_stride,
                FORMAT, BITS,
            )  # fmt: skip
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    n: int,
    fmt_code: int,
    *,
    scales: torch.Tensor | None = None,
    zeros: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    row_bytes: int = 0,
    group_size: int = 1,
    scale_stride: int = 0,
    bits: int = 4,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    require_matching_triton_mode(_quant_gemm_kernel, x.device)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    cfg = config or QuantGemmConfig.for_rows(x.shape[0], x.dtype)
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    dummy = w  # pointer arguments a format does not read
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _quant_gemm_kernel[grid](
        x, w,
        dummy if scales is None else scales,
        dummy if zeros is None else zeros,
        dummy if g_idx is None else g_idx,
        out, m, n, k, x.stride(0), row_bytes, group_size, scale_stride,
        FORMAT=fmt_code, BITS=bits, IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )  # fmt: skip
    return out


def gguf_matmul(
    x: torch.Tensor,
    fmt: QuantFormat,
    data: torch.Tensor,
    cols: int,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, cols] @ W.T`` with ``W`` as GGUF blocks ``data [N, row_bytes]`` uint8."""
    check_quantized(fmt, data, cols)
    if x.shape[-1] != cols or x.device != data.device:
        raise ValueError(f"x must be [M, {cols}] on {data.device}, got {tuple(x.shape)}")
    if not data.is_contiguous():
        raise ValueError("data must be contiguous")
    return _launch(x, data, data.shape[0], _GGUF_CODES[fmt], row_bytes=data.shape[1], config=config)


def awq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` with ``W`` in AWQ's GEMM layout (``torch_weight_only``)."""
    k, packed_n = qweight.shape
    n = packed_n * 8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("AWQ qweight and qzeros must be int32")
    if k % group_size or qzeros.shape != (k // group_size, packed_n):
        raise ValueError(f"AWQ qzeros must be [{k // group_size}, {packed_n}]")
    if scales.shape != (k // group_size, n):
        raise ValueError(f"AWQ scales must be [{k // group_size}, {n}]")
    if x.shape[-1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    return _launch(
        x, qweight.contiguous(), n, _AWQ, scales=scales.contiguous(), zeros=qzeros.contiguous(),
        group_size=group_size, config=config,
    )  # fmt: skip


def gptq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` with ``W`` in GPTQ's layout (v1 zero points; 4 or 8 bits)."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
    per = 32 // bits
    packed_k, n = qweight.shape
    k = packed_k * per
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("GPTQ qweight and qzeros must be int32")
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], n // per):
        raise ValueError(f"GPTQ scales must be [groups, {n}] and qzeros [groups, {n // per}]")
    if x.shape[-1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    groups = (
        torch.arange(k, device=x.device, dtype=torch.int32) // group_size
        if g_idx is None
        else g_idx.to(torch.int32).contiguous()
    )
    return _launch(
        x, qweight.contiguous(), n, _GPTQ, scales=scales.contiguous(), zeros=qzeros.contiguous(),
        g_idx=groups, bits=bits, config=config,
    )  # fmt: skip


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: QuantGemmConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale).T``: float8_e4m3fn ``[N, K]``, scale ``[1]`` or ``[N]``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weights must be float8_e4m3fn (e4m3), got {weight.dtype}")
    n, k = weight.shape
    if scale.numel() not in (1, n):
        raise ValueError(f"an FP8 scale is per tensor (1) or per output channel ({n})")
    if x.shape[-1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    return _launch(
        x, weight.contiguous().view(torch.uint8), n, _FP8,
        scales=scale.float().reshape(-1).contiguous(),
        scale_stride=0 if scale.numel() == 1 else 1, config=config,
    )  # fmt: skip
