"""The Triton dequantize-in-the-GEMM kernels compiled on a CUDA GPU (marked ``gpu``).

Run: ``pytest -m gpu tests/kernels/test_kernels_triton_quant_gpu.py``. Every format against the
float64 product with the specification's dequantized weight, ``x.double() @ W.double().T``
(``W`` from :func:`~kvgate.kernels.quant_formats.dequantize` and ``torch_weight_only``), at
layer-sized shapes: K 2048 or 4096, N not a multiple of any tile, M 1, 5, 64 and 300.

Bounds on the relative norm error ``||out - ref|| / ||ref||`` (x Gaussian, so the error of each
output is about the per-element rounding error times the output's own size):

* float32: 1e-5. The kernel multiplies with IEEE float32 dots (no tf32), so only summation order
  and the fused multiply-adds of the dequantization differ: ~1e-7 measured on CPU.
* float16: 2e-3. Each weight is rounded to fp16 for the tensor-core dot and the output is stored
  in fp16: two roundings of at most 2**-11 relative, ~3e-4 together for random signs.
* bfloat16: 1e-2. The same two roundings at 2**-8 relative: ~2e-3 together.

Compiles are the cost on the GPU (one per format, dtype and 16-divisibility class of M), so each
format runs every dtype once, with M rotating over the cases instead of every M for every one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvgate.kernels.quant_formats import QuantFormat, dequantize
from kvgate.kernels.torch_weight_only import awq_dequantize, fp8_dequantize, gptq_dequantize
from tests.kernels.test_kernels_quant import random_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]

DEVICE = torch.device("cuda")
REL_ERROR_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
ROW_COUNTS = (1, 5, 64, 300)
GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantWeight:
    """A stored quantized weight: the kernel that multiplies by it, and its float32 meaning."""

    matmul: Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> [M, N] in x's dtype
    dense: torch.Tensor  # [N, K] float32, the specification's dequantization


WeightBuilder = Callable[[int, int, int, torch.device], QuantWeight]  # (n, k, seed, device)


def _random_int32(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Random packed words: every bit pattern is a valid packing of 4- or 8-bit fields."""
    data = torch.randint(0, 256, (rows, cols * 4), dtype=torch.uint8, generator=generator)
    return data.view(torch.int32)


def _scales(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.rand(rows, cols, generator=generator) * 0.05 + 1e-3).half()


def gguf_weight(fmt: QuantFormat) -> WeightBuilder:
    def build(n: int, k: int, seed: int, device: torch.device) -> QuantWeight:
        from kvgate.kernels.triton_quant import gguf_matmul

        data = random_blocks(fmt, n, k, seed).to(device)
        return QuantWeight(lambda x: gguf_matmul(x, fmt, data, k), dequantize(fmt, data, k))

    return build


def awq_weight(n: int, k: int, seed: int, device: torch.device) -> QuantWeight:
    from kvgate.kernels.triton_quant import awq_matmul

    generator = torch.Generator().manual_seed(seed)
    groups = k // GROUP_SIZE
    qweight = _random_int32(k, n // 8, generator).to(device)
    qzeros = _random_int32(groups, n // 8, generator).to(device)
    scales = _scales(groups, n, generator).to(device)
    return QuantWeight(
        lambda x: awq_matmul(x, qweight, qzeros, scales, GROUP_SIZE),
        awq_dequantize(qweight, qzeros, scales, GROUP_SIZE),
    )


def gptq_weight(bits: int, act_order: bool) -> WeightBuilder:
    def build(n: int, k: int, seed: int, device: torch.device) -> QuantWeight:
        from kvgate.kernels.triton_quant import gptq_matmul

        generator = torch.Generator().manual_seed(seed)
        per = 32 // bits
        groups = k // GROUP_SIZE
        qweight = _random_int32(k // per, n, generator).to(device)
        qzeros = _random_int32(groups, n // per, generator).to(device)
        scales = _scales(groups, n, generator).to(device)
        g_idx = None
        if act_order:  # each input row in a random group, as act-order checkpoints store it
            order = torch.randperm(k, generator=generator)
            g_idx = (order // GROUP_SIZE).to(torch.int32).to(device)
        return QuantWeight(
            lambda x: gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, GROUP_SIZE),
            gptq_dequantize(qweight, qzeros, scales, g_idx, bits, GROUP_SIZE),
        )

    return build


def fp8_weight(per_channel: bool) -> WeightBuilder:
    def build(n: int, k: int, seed: int, device: torch.device) -> QuantWeight:
        from kvgate.kernels.triton_quant import fp8_matmul

        generator = torch.Generator().manual_seed(seed)
        weight = (torch.randn(n, k, generator=generator) * 40).to(torch.float8_e4m3fn)
        scale = torch.rand(n if per_channel else 1, generator=generator) * 0.01 + 1e-3
        weight, scale = weight.to(device), scale.to(device)
        return QuantWeight(lambda x: fp8_matmul(x, weight, scale), fp8_dequantize(weight, scale))

    return build


# (id, builder, N, K): N never a multiple of 16 (so never of a tile), but of 8 (AWQ packing).
FORMATS: list[tuple[str, WeightBuilder, int, int]] = [
    ("Q8_0", gguf_weight(QuantFormat.Q8_0), 1000, 4096),
    ("Q4_0", gguf_weight(QuantFormat.Q4_0), 2056, 2048),
    ("Q4_1", gguf_weight(QuantFormat.Q4_1), 1448, 4096),
    ("Q4_K", gguf_weight(QuantFormat.Q4_K), 2984, 4096),
    ("Q5_K", gguf_weight(QuantFormat.Q5_K), 1000, 2048),
    ("Q6_K", gguf_weight(QuantFormat.Q6_K), 2056, 4096),
    ("awq-int4-g128", awq_weight, 1448, 4096),
    ("gptq-int4-g128", gptq_weight(4, act_order=False), 2984, 2048),
    ("gptq-int4-g128-act-order", gptq_weight(4, act_order=True), 1000, 4096),
    ("gptq-int8-g128", gptq_weight(8, act_order=False), 2056, 2048),
    ("fp8-per-tensor", fp8_weight(per_channel=False), 1448, 4096),
    ("fp8-per-channel", fp8_weight(per_channel=True), 2984, 2048),
]


def _cases() -> list[object]:
    """Every format in every dtype, M rotating over ROW_COUNTS (one compile per pair)."""
    cases = []
    for index, (name, builder, n, k) in enumerate(FORMATS):
        for d, (dtype, dtype_id) in enumerate(zip(DTYPES, DTYPE_IDS, strict=True)):
            m = ROW_COUNTS[(index + d) % len(ROW_COUNTS)]
            case_id = f"{name}-{dtype_id}-M{m}"
            cases.append(pytest.param(builder, n, k, dtype, m, 100 * index + d, id=case_id))
    return cases


CASES = _cases()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def check_against_reference(
    builder: WeightBuilder,
    n: int,
    k: int,
    dtype: torch.dtype,
    m: int,
    seed: int,
    device: torch.device,
    x_row_stride: int | None = None,
) -> float:
    """Run one case; assert shape, dtype, finiteness and the bound; return the error."""
    weight = builder(n, k, seed, device)
    generator = torch.Generator().manual_seed(seed + 1)
    width = k if x_row_stride is None else x_row_stride
    x = torch.randn(m, width, generator=generator).to(device=device, dtype=dtype)[:, :k]
    out = weight.matmul(x)
    assert out.shape == (m, n) and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    error = relative_error(out, x.double() @ weight.dense.double().T)
    assert error <= REL_ERROR_BOUND[dtype], f"relative error {error:.2e}"
    return error


@pytest.mark.parametrize(("builder", "n", "k", "dtype", "m", "seed"), CASES)
def test_compiled_gemm_matches_float64_reference(
    builder: WeightBuilder, n: int, k: int, dtype: torch.dtype, m: int, seed: int
) -> None:
    check_against_reference(builder, n, k, dtype, m, seed, DEVICE)


def test_activations_as_a_row_slice_of_a_wider_tensor() -> None:
    # x [5, 2048] inside rows of 2072 elements: stride(0) != K and not a multiple of 16.
    builder = gptq_weight(4, act_order=True)
    check_against_reference(builder, 1448, 2048, torch.float16, 5, 7, DEVICE, x_row_stride=2072)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_does_not_depend_on_its_batch_under_one_tiling(dtype: torch.dtype) -> None:
    """Row 0 alone equals row 0 in a batch of 64, bit for bit, under one tiling.

    True by construction: every output element sums its K-steps in the same order whatever the
    other rows of its tile hold. The default tiling (``QuantGemmConfig.for_rows``) changes with
    M for 16-bit activations, and with it the K-step length: there a row's bits may change with
    its batch's size (seen on an H200 in bf16; float32 keeps one tiling).
    """
    from kvgate.kernels.triton_quant import QuantGemmConfig, gguf_matmul

    data = random_blocks(QuantFormat.Q4_K, 2984, 4096, 31).to(DEVICE)
    generator = torch.Generator().manual_seed(32)
    batch = torch.randn(64, 4096, generator=generator).to(device=DEVICE, dtype=dtype)
    tiling = QuantGemmConfig()
    alone = gguf_matmul(batch[:1], QuantFormat.Q4_K, data, 4096, tiling)
    assert torch.equal(alone[0], gguf_matmul(batch, QuantFormat.Q4_K, data, 4096, tiling)[0])
