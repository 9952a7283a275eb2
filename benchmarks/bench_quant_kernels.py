"""Triton dequantize-in-the-GEMM kernels against cuBLAS bf16 on the dequantized weight, one run.

    PYTHONPATH=. python3 benchmarks/bench_quant_kernels.py                # every format and M
    PYTHONPATH=. python3 benchmarks/bench_quant_kernels.py --only Q4_K,awq --m 1,16
    PYTHONPATH=. python3 benchmarks/bench_quant_kernels.py --sweep        # plus tilings
    PYTHONPATH=. python3 benchmarks/bench_quant_kernels.py --smoke [--sweep]  # CPU, interpreter

The layers of an 8B-class model (N x K): qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336, at M rows of bf16 activations. The baseline is ``x @ W_bf16.T`` (cuBLAS) with
``W_bf16`` the same weight dequantized, timed in the same run. Both are timed with
``triton.testing.do_bench`` (median) while rotating over copies of the weight that together
exceed ``ROTATION_BYTES``, so no repetition finds its weight in the 60 MB L2.

Figures:
  ratio    baseline ms / ours ms: above 1 the quantized kernel is faster
  GB/s     the stored weight's bytes (quants, scales, zeros, g_idx) / our time; %peak of --peak-gbs
  TFLOP/s  2 M N K / our time

Weights are random bytes (GGUF: every fp16 scale kept small, see ``gguf_weight``); the timing
does not depend on the values, and each case first checks that ours and the baseline agree.

``--smoke`` runs tiny shapes on CPU under ``TRITON_INTERPRET=1`` with float16 activations (the
interpreter's bf16 dot is wrong in Triton 3.9: it multiplies the raw bits), only so that the
script's code paths run without a GPU: its times say nothing about the kernels.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.kernels.quant_formats import QuantFormat, dequantize
from kvgate.kernels.torch_weight_only import awq_dequantize, fp8_dequantize, gptq_dequantize

if TYPE_CHECKING:
    from kvgate.kernels.triton_quant import QuantGemmConfig

# Copies of a weight the timing loops rotate over together exceed this (L2 is 60 MB on an H200).
ROTATION_BYTES = 200e6
GROUP_SIZE = 128
# ours and the baseline both round the weight to bf16; they differ by summation order and the
# output's rounding (~2e-3 relative norm), so a larger gap is a wrong kernel, not noise.
AGREEMENT_BOUND = 1e-2


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int


LAYER_SHAPES = [
    Shape("qkv", 6144, 4096),
    Shape("o", 4096, 4096),
    Shape("gate_up", 28672, 4096),
    Shape("down", 4096, 14336),
]
SMOKE_SHAPES = [Shape("tiny", 96, 512)]
ROW_COUNTS = (1, 16, 64, 256, 1024)
SMOKE_ROW_COUNTS = (1, 16)


@dataclass(frozen=True)
class QuantWeight:
    """A stored weight (one copy) and how the kernel multiplies by it."""

    tensors: tuple[torch.Tensor, ...]  # what the kernel reads
    multiply: Callable[
        [tuple[torch.Tensor, ...], torch.Tensor, QuantGemmConfig | None], torch.Tensor
    ]
    dense: torch.Tensor  # [N, K] float32, the specification's dequantization

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def copies(self, count: int) -> list[tuple[torch.Tensor, ...]]:
        return [self.tensors] + [tuple(t.clone() for t in self.tensors) for _ in range(count - 1)]


def _bytes(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator, device=device)


def _int32(rows: int, cols: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random packed words: every bit pattern is a valid packing of 4- or 8-bit fields."""
    return _bytes((rows, 4 * cols), generator, device).view(torch.int32)


def _scales(rows: int, cols: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.rand(rows, cols, generator=generator, device=device) * 0.05 + 1e-3).half()


def gguf_weight(fmt: QuantFormat) -> Callable[[Shape, torch.Generator], QuantWeight]:
    def build(shape: Shape, generator: torch.Generator) -> QuantWeight:
        from kvgate.kernels.quant_formats import LAYOUTS
        from kvgate.kernels.triton_quant import gguf_matmul

        device = generator.device
        data = _bytes((shape.n, LAYOUTS[fmt].row_bytes(shape.k)), generator, device)
        # Every fp16 field of a block sits at an even byte offset (blocks are an even number of
        # bytes), so clearing the top three bits of each odd byte (sign, two exponent bits)
        # leaves every fp16 in [0, 2**-7): finite, and of the size of real block scales.
        data[:, 1::2] &= 0x1F
        return QuantWeight(
            (data,),
            lambda t, x, config: gguf_matmul(x, fmt, t[0], shape.k, config),
            dequantize(fmt, data, shape.k),
        )

    return build


def awq_weight(shape: Shape, generator: torch.Generator) -> QuantWeight:
    from kvgate.kernels.triton_quant import awq_matmul

    device, groups = generator.device, shape.k // GROUP_SIZE
    qweight = _int32(shape.k, shape.n // 8, generator, device)
    qzeros = _int32(groups, shape.n // 8, generator, device)
    scales = _scales(groups, shape.n, generator, device)
    return QuantWeight(
        (qweight, qzeros, scales),
        lambda t, x, config: awq_matmul(x, t[0], t[1], t[2], GROUP_SIZE, config),
        awq_dequantize(qweight, qzeros, scales, GROUP_SIZE),
    )


def gptq_weight(shape: Shape, generator: torch.Generator) -> QuantWeight:
    from kvgate.kernels.triton_quant import gptq_matmul

    device, groups = generator.device, shape.k // GROUP_SIZE
    qweight = _int32(shape.k // 8, shape.n, generator, device)
    qzeros = _int32(groups, shape.n // 8, generator, device)
    scales = _scales(groups, shape.n, generator, device)
    return QuantWeight(
        (qweight, qzeros, scales),
        lambda t, x, config: gptq_matmul(x, t[0], t[1], t[2], None, 4, GROUP_SIZE, config),
        gptq_dequantize(qweight, qzeros, scales, None, 4, GROUP_SIZE),
    )


def fp8_weight(shape: Shape, generator: torch.Generator) -> QuantWeight:
    from kvgate.kernels.triton_quant import fp8_matmul

    device = generator.device
    weight = torch.randn(shape.n, shape.k, generator=generator, device=device) * 40
    weight = weight.to(torch.float8_e4m3fn)
    scale = torch.rand(shape.n, generator=generator, device=device) * 0.01 + 1e-3
    return QuantWeight(
        (weight, scale),
        lambda t, x, config: fp8_matmul(x, t[0], t[1], config),
        fp8_dequantize(weight, scale),
    )


# --only names (case-insensitive) -> (label, builder)
FORMATS: dict[str, tuple[str, Callable[[Shape, torch.Generator], QuantWeight]]] = {
    "Q4_K": ("Q4_K", gguf_weight(QuantFormat.Q4_K)),
    "Q6_K": ("Q6_K", gguf_weight(QuantFormat.Q6_K)),
    "Q8_0": ("Q8_0", gguf_weight(QuantFormat.Q8_0)),
    "Q4_0": ("Q4_0", gguf_weight(QuantFormat.Q4_0)),
    "AWQ": ("AWQ int4 g128", awq_weight),
    "GPTQ": ("GPTQ int4 g128", gptq_weight),
    "FP8": ("FP8 per-channel", fp8_weight),
}
# (format, layer, M) timed with every sweep_configs() tiling under --sweep.
SWEEP_CASES = [
    ("Q4_K", "qkv", 1),
    ("AWQ", "gate_up", 16),
    ("Q6_K", "down", 256),
    ("GPTQ", "o", 1024),
]
SMOKE_SWEEP_CASES = [("Q4_K", "tiny", 1), ("AWQ", "tiny", 16)]


def sweep_configs(m: int, smoke: bool) -> list[QuantGemmConfig]:
    """About a dozen tilings; tiles taller than 16 rows only where M fills them."""
    from kvgate.kernels.triton_quant import QuantGemmConfig as Config

    if smoke:
        return [Config(16, 64, 64, 4, None), Config(32, 32, 32, 4, 2)]
    if m <= 16:
        return [
            Config(16, block_n, block_k, warps, stages)
            for block_n, block_k in ((32, 32), (32, 64), (64, 32), (64, 64), (128, 32), (32, 128))
            for warps, stages in ((4, 3), (4, 4))
        ]
    return [
        Config(block_m, block_n, block_k, warps, stages)
        for block_m, block_n, block_k, warps in (
            (32, 64, 32, 4),
            (32, 64, 64, 4),
            (64, 64, 32, 4),
            (64, 64, 64, 4),
            (64, 128, 32, 8),
            (64, 128, 64, 8),
            (128, 64, 32, 8),
        )
        for stages in (2, 3)
    ]


def rotating(fns: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """One call per copy in turn, so consecutive repetitions read different weight memory."""
    state = {"next": 0}

    def run() -> torch.Tensor:
        index = state["next"]
        state["next"] = (index + 1) % len(fns)
        return fns[index]()

    return run


def time_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_count(nbytes: int, device: torch.device) -> int:
    return max(2, math.ceil(ROTATION_BYTES / nbytes)) if device.type == "cuda" else 2


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@dataclass
class Layer:
    """One format at one layer shape: its weight copies and the bf16 baseline's copies."""

    label: str
    weight: QuantWeight
    copies: list[tuple[torch.Tensor, ...]]
    baseline_copies: list[torch.Tensor]  # [N, K] in the activations' dtype


def make_layer(fmt: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> Layer:
    label, build = FORMATS[fmt]
    weight = build(shape, torch.Generator(device=device).manual_seed(0))
    dense = weight.dense.to(dtype)
    baseline_bytes = dense.numel() * dense.element_size()
    return Layer(
        label,
        weight,
        weight.copies(copy_count(weight.nbytes, device)),
        [dense] + [dense.clone() for _ in range(copy_count(baseline_bytes, device) - 1)],
    )


def ours_fn(
    layer: Layer, x: torch.Tensor, config: QuantGemmConfig | None = None
) -> Callable[[], torch.Tensor]:
    multiply = layer.weight.multiply
    return rotating([lambda t=t: multiply(t, x, config) for t in layer.copies])


def baseline_fn(layer: Layer, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return rotating([lambda w=w: x @ w.T for w in layer.baseline_copies])


def agrees(ours: torch.Tensor, baseline: torch.Tensor, what: str) -> bool:
    """Same answer first: a fast wrong kernel is not a result (reported, then skipped)."""
    error = relative_error(ours, baseline)
    if error <= AGREEMENT_BOUND:  # False for NaN too
        return True
    print(f"WRONG: {what} differs from the baseline by {error:.2e}", file=sys.stderr, flush=True)
    return False


def run_layer(
    layer: Layer,
    shape: Shape,
    row_counts: list[int],
    dtype: torch.dtype,
    device: torch.device,
    peak_gbs: float,
    baseline_ms: dict[tuple[str, int], float],
) -> bool:
    """Print one table row per M; return whether every case agreed with the baseline."""
    all_agree = True
    generator = torch.Generator(device=device).manual_seed(1)
    for m in row_counts:
        x = torch.randn(m, shape.k, generator=generator, device=device).to(dtype)
        ours, baseline = ours_fn(layer, x), baseline_fn(layer, x)
        what = f"{layer.label} {shape.name} M={m}"
        if not agrees(ours(), baseline(), what):
            print(f"| {layer.label} | {shape.name} | {m} | WRONG (see stderr) |", flush=True)
            all_agree = False
            continue
        ours_ms = time_ms(ours, device)
        # cuBLAS's time does not depend on the values: once per shape and M, on the first format.
        if (shape.name, m) not in baseline_ms:
            baseline_ms[shape.name, m] = time_ms(baseline, device)
        base_ms = baseline_ms[shape.name, m]
        gbs = layer.weight.nbytes / ours_ms / 1e6
        cells = [
            layer.label,
            f"{shape.name} {shape.n}x{shape.k}",
            str(m),
            f"{ours_ms:.4f}",
            f"{base_ms:.4f}",
            f"{base_ms / ours_ms:.2f}x",
            f"{gbs:.0f}",
            f"{100 * gbs / peak_gbs:.1f}%",
            f"{2 * m * shape.n * shape.k / ours_ms / 1e9:.2f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    return all_agree


def run_sweep(
    cases: list[tuple[str, str, int]],
    shapes: list[Shape],
    dtype: torch.dtype,
    device: torch.device,
    smoke: bool,
) -> None:
    by_name = {shape.name: shape for shape in shapes}
    print("\nsweep: best three tilings per case (QuantGemmConfig), default first", flush=True)
    for index, (fmt, shape_name, m) in enumerate(cases):
        shape = by_name[shape_name]
        layer = make_layer(fmt, shape, dtype, device)
        x = torch.randn(m, shape.k, generator=torch.Generator().manual_seed(2)).to(device)
        x = x.to(device=device, dtype=dtype)
        expected = baseline_fn(layer, x)()
        default_ms = time_ms(ours_fn(layer, x), device)
        configs = sweep_configs(m, smoke)
        print(
            f"[{index + 1}/{len(cases)}] {layer.label} {shape.name} M={m}: {len(configs)} configs",
            file=sys.stderr,
            flush=True,
        )
        results = []
        for config in configs:
            fn = ours_fn(layer, x, config)
            try:
                if agrees(fn(), expected, f"{layer.label} {config}"):
                    results.append((time_ms(fn, device), config))
            except Exception as error:  # a tiling the compiler rejects (e.g. shared memory)
                print(f"    {config} failed: {type(error).__name__}", file=sys.stderr, flush=True)
        results.sort(key=lambda item: item[0])
        print(f"{layer.label} {shape.name} M={m}: default {default_ms:.4f} ms", flush=True)
        for ms, config in results[:3]:
            print(f"    {ms:.4f} ms ({default_ms / ms:.2f}x of default) {config}", flush=True)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated formats of {', '.join(FORMATS)}")
    parser.add_argument("--m", help="comma-separated row counts (default 1,16,64,256,1024)")
    parser.add_argument("--sweep", action="store_true", help="also time tilings on SWEEP_CASES")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="peak HBM GB/s for %%peak")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1"
    )
    args = parser.parse_args()
    known = {name.upper(): name for name in FORMATS}
    only = [known.get(name.strip().upper()) for name in args.only.split(",")] if args.only else []
    if None in only:
        parser.error(f"--only takes formats among {', '.join(FORMATS)}")
    args.formats = only or list(FORMATS)
    default_rows = SMOKE_ROW_COUNTS if args.smoke else ROW_COUNTS
    args.row_counts = [int(m) for m in args.m.split(",")] if args.m else list(default_rows)
    return args


def main() -> int:
    args = parse_args()
    if args.smoke:
        # Triton fixes interpreted-vs-compiled at its first import: before anything imports it.
        os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, shapes = torch.device("cpu"), torch.float16, SMOKE_SHAPES
    elif torch.cuda.is_available():
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, LAYER_SHAPES
    else:
        raise SystemExit("no CUDA device: run with --smoke to exercise the script on CPU")
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(
        f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"activations {dtype}; peak {args.peak_gbs:.0f} GB/s"
    )
    if args.smoke:
        print("SMOKE: tiny shapes under the Triton interpreter; the times mean nothing.")
    columns = ["format", "shape (N x K)", "M", "ours ms", "baseline ms", "ratio", "GB/s",
               "% peak", "TFLOP/s"]  # fmt: skip
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)
    baseline_ms: dict[tuple[str, int], float] = {}
    failures = 0
    for shape in shapes:
        for fmt in args.formats:
            # One format failing (a compile error, a wrong result) must not cost the others.
            try:
                layer = make_layer(fmt, shape, dtype, device)
                rows = args.row_counts
                if not run_layer(layer, shape, rows, dtype, device, args.peak_gbs, baseline_ms):
                    failures += 1
                del layer
            except Exception as error:
                failures += 1
                print(f"| {fmt} | {shape.name} | FAILED: {type(error).__name__}: {error} |")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.sweep:
        cases = SMOKE_SWEEP_CASES if args.smoke else SWEEP_CASES
        run_sweep([case for case in cases if case[0] in args.formats], shapes, dtype, device,
                  args.smoke)  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
