"""The float-activation quantized product (``quant.float_matmul``: ``matmul_float`` in quant.cpp
below 16 rows, chunks dequantized into oneDNN from 16 rows on).

- the kernel's own dequantization (its vector path and its scalar one) gives
  ``quant_formats.dequantize``'s float32 values bit for bit, every format;
- its products stay within ``FLOAT_REL_BOUND`` of the float64 product of x with the dequantized
  matrix, at every row count (the decode path below 16 rows, oneDNN's GEMM from 16 on, the
  row-by-row mode at any count), with a row count of W that is not a multiple of four, on one
  thread and two: float32 summation error, about a thousandth of the int8 path's;
- below 16 rows, and at any count row by row, a row's output does not depend on its batch.
"""

from __future__ import annotations

import pytest
import torch

from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.kernels.quant_formats import QuantFormat, dequantize
from kvgate.kernels.torch_quant import K_QUANTS, quantized_matmul_reference
from tests.kernels.test_kernels_quant import REL_RMS_BOUND, random_blocks

# Relative norm of the error against the float64 product, Gaussian x, random blocks: measured
# 0.7e-7 to 3.7e-7 over the formats and row counts (float32 sums of 512-832 terms).
FLOAT_REL_BOUND = 2e-6


@pytest.fixture(scope="module")
def compiled(compiled_quant: cpu_quant.QuantLoadResult) -> cpu_quant.QuantLoadResult:
    return compiled_quant


def _widths(fmt: QuantFormat) -> tuple[int, ...]:
    return (768,) if fmt in K_QUANTS else (768, 832)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
def test_the_kernels_weights_are_the_dequantized_values_bit_for_bit(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat, vector: bool
) -> None:
    for cols in _widths(fmt):
        data = random_blocks(fmt, 37, cols, seed=11)
        ours = cpu_quant.compiled_dequantize(fmt, data, cols, vector=vector)
        assert torch.equal(ours, dequantize(fmt, data, cols)), (fmt, cols)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_product_is_the_dequantized_matrixs_within_float32_rounding(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat, threads: int
) -> None:
    generator = torch.Generator().manual_seed(12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for cols in _widths(fmt):
            data = random_blocks(fmt, 37, cols, seed=13)
            weight = dequantize(fmt, data, cols).double()
            for n in (1, 2, 3, 4, 5, 9, 15, 16, 17, 40):
                x = torch.randn(n, cols, generator=generator) * 3
                x[0, :40] = 0.0
                exact = x.double() @ weight.T
                for row_by_row in (False, True):
                    ours = cpu_quant.float_matmul(
                        x, fmt, data, cols, compiled=True, row_by_row=row_by_row
                    )
                    relative = float((ours.double() - exact).norm() / exact.norm())
                    assert relative < FLOAT_REL_BOUND, (fmt, cols, n, row_by_row, relative)
    finally:
        torch.set_num_threads(before)


def test_float_activations_are_far_closer_than_int8_ones(
    compiled: cpu_quant.QuantLoadResult,
) -> None:
    """What the choice buys: the int8 path's error is thousands of times the float path's."""
    data = random_blocks(QuantFormat.Q4_1, 64, 512, seed=14)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(15))
    exact = x.double() @ dequantize(QuantFormat.Q4_1, data, 512).double().T
    floats = cpu_quant.float_matmul(x, QuantFormat.Q4_1, data, 512, compiled=True).double()
    int8 = quantized_matmul_reference(x, QuantFormat.Q4_1, data, 512).double()
    float_error = float((floats - exact).norm() / exact.norm())
    int8_error = float((int8 - exact).norm() / exact.norm())
    assert float_error < FLOAT_REL_BOUND < REL_RMS_BOUND / 1000
    assert int8_error > 1000 * float_error


@pytest.mark.parametrize("fmt", [QuantFormat.Q4_1, QuantFormat.Q6_K, QuantFormat.Q8_0])
def test_a_rows_output_does_not_depend_on_its_batch(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat
) -> None:
    data = random_blocks(fmt, 37, 512, seed=16)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(17))
    few = cpu_quant.float_matmul(x[:13], fmt, data, 512, compiled=True)
    many = cpu_quant.float_matmul(x, fmt, data, 512, compiled=True, row_by_row=True)
    for row in (0, 5, 12):
        alone = cpu_quant.float_matmul(x[row : row + 1], fmt, data, 512, compiled=True)
        assert torch.equal(alone[0], few[row])
        assert torch.equal(alone[0], many[row])


def test_the_torch_fallback_is_the_dequantized_product() -> None:
    """Where no compiler built the kernel: the dequantized matrix, whole or a row at a time."""
    data = random_blocks(QuantFormat.Q4_K, 9, 512, seed=18)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(19))
    expected = x @ dequantize(QuantFormat.Q4_K, data, 512).T
    whole = cpu_quant.float_matmul(x, QuantFormat.Q4_K, data, 512, compiled=False)
    rows = cpu_quant.float_matmul(x, QuantFormat.Q4_K, data, 512, compiled=False, row_by_row=True)
    assert torch.equal(whole, expected)
    torch.testing.assert_close(rows, expected)


def test_the_kernel_refuses_rows_of_the_wrong_size(compiled: cpu_quant.QuantLoadResult) -> None:
    data = random_blocks(QuantFormat.Q4_1, 4, 64, seed=20)
    with pytest.raises(RuntimeError, match="data rows must be 40 bytes"):
        torch.ops.kvgate_quant.matmul_float(torch.zeros(1, 64), data[:, :30].contiguous(), 2, 64)


def test_a_matrix_of_several_chunks_is_multiplied_whole(
    compiled: cpu_quant.QuantLoadResult,
) -> None:
    cols = 768
    rows = 2 * cpu_quant.FLOAT_CHUNK_VALUES // cols + 5  # two whole chunks and five rows over
    data = random_blocks(QuantFormat.Q4_0, rows, cols, seed=21)
    x = torch.randn(cpu_quant.FLOAT_GEMM_ROWS, cols, generator=torch.Generator().manual_seed(22))
    exact = x.double() @ dequantize(QuantFormat.Q4_0, data, cols).double().T
    ours = cpu_quant.float_matmul(x, QuantFormat.Q4_0, data, cols, compiled=True)
    assert ours.shape == (cpu_quant.FLOAT_GEMM_ROWS, rows)
    assert float((ours.double() - exact).norm() / exact.norm()) < FLOAT_REL_BOUND
