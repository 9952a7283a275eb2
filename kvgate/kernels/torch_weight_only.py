"""Weight-only quantized checkpoints (AWQ, GPTQ, FP8): their layouts and dequantization in torch.

The specification the Triton GEMMs (:mod:`kvgate.kernels.triton_quant`) are tested against.
``y = x @ W.T`` with ``W [N, K]`` (out, in) rebuilt from::

    AWQ  (GEMM layout, 4 bits, zero points)
         qweight int32 [K, N / 8]   eight 4-bit values of consecutive output columns per int32,
                                    column 8 c + j in nibble AWQ_NIBBLE[j] (AutoAWQ's order)
         qzeros  int32 [K / G, N / 8]  the same packing
         scales  f16   [K / G, N]   W[n, k] = (q - z) * s  of group k // G
    GPTQ (4 or 8 bits)
         qweight int32 [K * bits / 32, N]  values of consecutive input rows packed low bits first
         qzeros  int32 [G', N * bits / 32]  packed along N; stored as zero - 1 (the v1 format
                                    AutoGPTQ and transformers write), so the zero is stored + 1
         scales  f16   [G', N]
         g_idx   int32 [K]          each input row's group (act-order); absent: k // G
    FP8  weight float8_e4m3fn [N, K], weight_scale float32: one per tensor or one per output row
         W = weight * scale

Symmetric GPTQ stores a zero point too (2 ** (bits - 1), as ``2 ** (bits - 1) - 1``).
"""

from __future__ import annotations

import torch

# AutoAWQ packs output columns 0..7 of a group into nibbles in the order 0 2 4 6 1 3 5 7:
# column j sits in nibble AWQ_NIBBLE[j].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def _nibbles(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., c]`` -> ``[..., c, 32 / bits]`` unsigned fields, lowest bits first."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AWQ's GEMM layout -> float32 ``W [N, K]``."""
    order = torch.tensor(AWQ_NIBBLE, device=qweight.device)
    q = _nibbles(qweight, 4)[..., order].reshape(qweight.shape[0], -1)  # [K, N]
    z = _nibbles(qzeros, 4)[..., order].reshape(qzeros.shape[0], -1)  # [K / G, N]
    z = z.repeat_interleave(group_size, 0)
    s = scales.float().repeat_interleave(group_size, 0)
    return ((q - z).float() * s).T.contiguous()


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """GPTQ (v1 zero points) -> float32 ``W [N, K]``."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
    n = qweight.shape[1]
    q = _nibbles(qweight.T, bits).reshape(n, -1)  # [N, K]
    k = q.shape[1]
    z = _nibbles(qzeros, bits).reshape(qzeros.shape[0], -1) + 1  # [groups, N]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    zero = z[groups].T  # [N, K]
    scale = scales.float()[groups].T
    return (q - zero).float() * scale


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``[N, K]`` times its per-tensor or per-row scale -> float32 ``[N, K]``."""
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return weight.float() * s


__all__ = ["AWQ_NIBBLE", "awq_dequantize", "fp8_dequantize", "gptq_dequantize"]
