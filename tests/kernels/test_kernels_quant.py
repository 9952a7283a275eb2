"""Quantized matrix products: the block formats, the int8 reference and the compiled CPU kernel.

- ``quant_formats.dequantize`` equals gguf-py's dequantizers bit for bit (every format);
- the int8 reference (``torch_quant``) stays within ``REL_RMS_BOUND`` of the float32 product
  with the dequantized weights (the price of int8 activations, as in llama.cpp);
- the compiled kernel (``kvgate/kernels/cpu/quant.cpp``) equals the reference bit for bit at
  every row count (tiles of four rows, padding) and thread count, so a row's output never
  depends on its batch.

Blocks are random bytes with small positive fp16 scales: every byte pattern is a valid block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.kernels.quant_formats import LAYOUTS, QuantFormat, dequantize
from kvgate.kernels.torch_quant import (
    K_QUANTS,
    quantize_activations,
    quantized_matmul_reference,
)

# Relative RMS error of the int8 path against x @ dequantize(W).T, Gaussian x, random blocks.
# Measured 0.52-0.83 % over the formats (Q5_K highest): int8 activations round each value by
# up to half a step of max|x| / 127 of its block.
REL_RMS_BOUND = 0.012
# Byte offsets of each format's fp16 scales (quant_formats' table).
_SCALE_OFFSETS = {
    QuantFormat.Q8_0: (0,),
    QuantFormat.Q4_0: (0,),
    QuantFormat.Q4_1: (0, 2),
    QuantFormat.Q4_K: (0, 2),
    QuantFormat.Q5_K: (0, 2),
    QuantFormat.Q6_K: (208,),
}


def random_blocks(fmt: QuantFormat, rows: int, cols: int, seed: int) -> torch.Tensor:
    layout = LAYOUTS[fmt]
    generator = torch.Generator().manual_seed(seed)
    nblocks = cols // layout.values
    data = torch.randint(
        0, 256, (rows, nblocks, layout.nbytes), dtype=torch.uint8, generator=generator
    )
    for offset in _SCALE_OFFSETS[fmt]:
        scales = (torch.rand(rows, nblocks, generator=generator) * 0.02 + 0.001).half()
        data[..., offset : offset + 2] = scales.view(torch.uint8).reshape(rows, nblocks, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_dequantize_equals_gguf_py(fmt: QuantFormat) -> None:
    gguf = pytest.importorskip("gguf")
    data = random_blocks(fmt, 6, 512, seed=1)
    ours = dequantize(fmt, data, 512)
    theirs = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[fmt.value])
    assert torch.equal(ours, torch.from_numpy(np.asarray(theirs, dtype=np.float32)).reshape(6, 512))


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_int8_reference_is_close_to_the_dequantized_product(fmt: QuantFormat) -> None:
    data = random_blocks(fmt, 48, 512, seed=2)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    exact = x @ dequantize(fmt, data, 512).T
    approx = quantized_matmul_reference(x, fmt, data, 512)
    relative = float((approx - exact).norm() / exact.norm())
    assert relative < REL_RMS_BOUND, (fmt, relative)


def test_activations_follow_the_rounding_rule() -> None:
    """d = max|x| / 127, q = rint(x / d) with ties to even, an all-zero block stays zero."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -3.5  # d = 1: 2.5 -> 2, -3.5 -> -4 (to even)
    acts = quantize_activations(x, 32)
    assert acts.q[0, :3].tolist() == [127, 2, -4]
    assert acts.d.tolist() == [[1.0, 0.0]]
    assert acts.q[0, 32:].abs().sum() == 0
    assert acts.sums[0].tolist() == [125, 0, 0, 0]


@pytest.fixture(scope="module")
def compiled(compiled_quant: cpu_quant.QuantLoadResult) -> cpu_quant.QuantLoadResult:
    return compiled_quant


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_kernel_equals_the_reference_bit_for_bit(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat, threads: int
) -> None:
    # 24 blocks of 32 (or 3 of 256); and 26 of 32, where a lone row's four-block groups leave
    # two blocks over
    widths = (768,) if fmt in K_QUANTS else (768, 832)
    generator = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for cols in widths:
            data = random_blocks(fmt, 37, cols, seed=4)
            for n in (1, 3, 4, 9, 13, 17):
                x = torch.randn(n, cols, generator=generator) * 3
                x[0, :40] = 0.0  # an all-zero activation block (scale 0)
                ours = cpu_quant.quantized_matmul(x, fmt, data, cols, compiled=True)
                reference = quantized_matmul_reference(x, fmt, data, cols)
                assert torch.equal(ours, reference), (fmt, cols, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", [QuantFormat.Q4_1, QuantFormat.Q6_K])
def test_a_rows_output_does_not_depend_on_its_batch(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat
) -> None:
    data = random_blocks(fmt, 64, 512, seed=6)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(7))
    batch = cpu_quant.quantized_matmul(x, fmt, data, 512, compiled=True)
    for row in (0, 5, 12):
        alone = cpu_quant.quantized_matmul(x[row : row + 1], fmt, data, 512, compiled=True)
        assert torch.equal(alone[0], batch[row])


def test_extreme_values_cannot_saturate_the_int16_pairs(
    compiled: cpu_quant.QuantLoadResult,
) -> None:
    """Q8_0 weights of -128 and 127 beside activations of +-127: the pair sums stay exact."""
    data = random_blocks(QuantFormat.Q8_0, 4, 64, seed=8).reshape(4, 2, 34)
    data[..., 2:] = torch.tensor([0x80, 0x7F], dtype=torch.uint8).repeat(16)
    data = data.reshape(4, 68)
    x = torch.tensor([[127.0, -127.0] * 32, [-127.0, -127.0] * 32])
    ours = cpu_quant.quantized_matmul(x, QuantFormat.Q8_0, data, 64, compiled=True)
    assert torch.equal(ours, quantized_matmul_reference(x, QuantFormat.Q8_0, data, 64))


def test_the_kernel_refuses_rows_of_the_wrong_size(compiled: cpu_quant.QuantLoadResult) -> None:
    data = random_blocks(QuantFormat.Q4_1, 4, 64, seed=9)
    with pytest.raises(RuntimeError, match="data rows must be 40 bytes"):
        torch.ops.kvgate_quant.matmul(torch.zeros(1, 64), data[:, :30].contiguous(), 2, 64)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantized_matmul_reference(torch.zeros(1, 48), QuantFormat.Q4_1, data, 48)


@pytest.mark.parametrize("fmt", list(cpu_quant.ROWS8_FORMATS))
def test_the_rows8_layout_gives_the_same_bits(
    compiled: cpu_quant.QuantLoadResult, fmt: QuantFormat
) -> None:
    """W in groups of eight rows (the CPU kernel's rows8 layout): the stored bytes come back
    exactly, and the products equal the reference bit for bit at every row count, with rows past
    the last whole group (37 = 4 groups + 5) and with none (64)."""
    if not cpu_quant.rows8_compiled(compiled):
        pytest.skip(f"the rows8 layout needs AVX2 ({compiled.log_line()})")
    generator = torch.Generator().manual_seed(9)
    cols = 768 if fmt in K_QUANTS else 832
    for rows in (37, 64):
        data = random_blocks(fmt, rows, cols, seed=10)
        repacked = cpu_quant.repack_rows8(fmt, data)
        assert repacked.shape == data.shape and not torch.equal(repacked, data)
        assert torch.equal(cpu_quant.unpack_rows8(fmt, repacked), data)
        for n in (1, 3, 4, 9, 13, 17):
            x = torch.randn(n, cols, generator=generator) * 3
            x[0, :40] = 0.0
            ours = cpu_quant.quantized_matmul_rows8(x, fmt, repacked, cols, compiled=True)
            assert torch.equal(ours, quantized_matmul_reference(x, fmt, data, cols)), (rows, n)
