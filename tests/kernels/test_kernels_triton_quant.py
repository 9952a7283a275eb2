"""Triton dequantize-in-the-GEMM kernels (interpreted) against dequantize-then-multiply.

Every GGUF block format, AWQ int4, GPTQ int4/int8 (with and without act-order ``g_idx``) and FP8
e4m3 (per-tensor and per-channel scales), float32 activations: the kernel's tiles see exactly
the dequantized values, so the only difference is summation order (``ATOL``). Shapes are tiny
(the interpreter is slow) but cover partial tiles in M and N and several K steps.
"""

from __future__ import annotations

import pytest
import torch

from kvgate.kernels.quant_formats import QuantFormat, dequantize
from kvgate.kernels.torch_weight_only import awq_dequantize, fp8_dequantize, gptq_dequantize
from tests.kernels.test_kernels_quant import random_blocks

pytestmark = pytest.mark.usefixtures("interpreted_triton")

# float32 sums of 256-512 products of values of size ~1e-2 .. 1: summation order only.
ATOL = 1e-4


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    assert float((actual - expected).abs().max()) <= ATOL * max(1.0, scale)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_gguf_gemm_equals_dequantize_then_multiply(fmt: QuantFormat) -> None:
    from kvgate.kernels.triton_quant import gguf_matmul

    cols = 512 if fmt.value.endswith("K") else 96
    data = random_blocks(fmt, 40, cols, seed=11)
    x = _x(5, cols, 12)
    _close(gguf_matmul(x, fmt, data, cols), x @ dequantize(fmt, data, cols).T)


def _packed(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit fields along ``dim`` into int32, lowest bits first."""
    per = 32 // bits
    moved = values.movedim(dim, -1)
    fields = moved.reshape(*moved.shape[:-1], -1, per).to(torch.int64)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = (fields << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim)


def test_awq_gemm_equals_dequantize_then_multiply() -> None:
    from kvgate.kernels.torch_weight_only import AWQ_NIBBLE
    from kvgate.kernels.triton_quant import awq_matmul

    k, n, group = 128, 48, 32
    generator = torch.Generator().manual_seed(13)
    q = torch.randint(0, 16, (k, n), generator=generator)
    z = torch.randint(0, 16, (k // group, n), generator=generator)
    scales = (torch.rand(k // group, n, generator=generator) * 0.05).half()
    # AutoAWQ's nibble order: column 8c + j of a group goes into nibble AWQ_NIBBLE[j].
    order = torch.tensor([AWQ_NIBBLE.index(i) for i in range(8)])

    def pack(values: torch.Tensor) -> torch.Tensor:
        grouped = values.reshape(values.shape[0], -1, 8)[..., order].reshape(values.shape)
        return _packed(grouped, 4, 1)

    qweight, qzeros = pack(q), pack(z)
    expected = (
        (q - z.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)
    ).T
    assert torch.equal(awq_dequantize(qweight, qzeros, scales, group), expected)
    x = _x(3, k, 14)
    _close(awq_matmul(x, qweight, qzeros, scales, group), x @ expected.T)


@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, False)])
def test_gptq_gemm_equals_dequantize_then_multiply(bits: int, act_order: bool) -> None:
    from kvgate.kernels.triton_quant import gptq_matmul

    k, n, group = 128, 40, 32
    generator = torch.Generator().manual_seed(15)
    q = torch.randint(0, 2**bits, (k, n), generator=generator)
    zero = torch.randint(1, 2**bits, (k // group, n), generator=generator)
    scales = (torch.rand(k // group, n, generator=generator) * 0.05).half()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=generator)]
    qweight = _packed(q, bits, 0)
    qzeros = _packed(zero - 1, bits, 1)  # v1: stored as zero - 1
    expected = ((q - zero[g_idx]).float() * scales.float()[g_idx]).T
    ours = gptq_dequantize(qweight, qzeros, scales, g_idx if act_order else None, bits, group)
    assert torch.equal(ours, expected)
    x = _x(4, k, 16)
    actual = gptq_matmul(x, qweight, qzeros, scales, g_idx if act_order else None, bits, group)
    _close(actual, x @ expected.T)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_gemm_equals_dequantize_then_multiply(per_channel: bool) -> None:
    from kvgate.kernels.triton_quant import fp8_matmul

    generator = torch.Generator().manual_seed(17)
    weight = (torch.randn(36, 64, generator=generator) * 40).to(torch.float8_e4m3fn)
    weight.view(torch.uint8)[0, :8] = torch.tensor(
        [0, 1, 7, 8, 0x80, 0x81, 0x7E, 0xFE], dtype=torch.uint8
    )
    scale = torch.rand(36 if per_channel else 1, generator=generator) * 0.01 + 1e-3
    x = _x(5, 64, 18)
    _close(fp8_matmul(x, weight, scale), x @ fp8_dequantize(weight, scale).T)


def test_formats_are_refused_by_name() -> None:
    from kvgate.kernels.triton_quant import fp8_matmul, gptq_matmul

    with pytest.raises(ValueError, match="e4m3"):
        fp8_matmul(torch.zeros(1, 16), torch.zeros(4, 16).to(torch.float8_e5m2), torch.ones(1))
    with pytest.raises(ValueError, match="3 bits"):
        gptq_matmul(
            torch.zeros(1, 32),
            torch.zeros(3, 8, dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, 8),
            None,
            3,
            32,
        )
