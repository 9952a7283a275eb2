"""The CPU quantized products alone: the stored block order against the rows8 layout.

    PYTHONPATH=. python benchmarks/bench_quant_cpu.py [--threads N] [--rows 1,4,32]

For each format and a few SmolLM2/8B-class shapes, the CPU time per product of
``kvgate_quant::matmul`` on the blocks as stored and of ``matmul_rows8`` on the same blocks
repacked in groups of eight rows (``kvgate.kernels.cpu.quant.repack_rows8``), best of five
repeats after a warm-up, and their ratio (above 1: rows8 faster). Both give the same bits (the
kernel tests); this only times them. To compare with an earlier commit, run it from that checkout.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvgate.executor.quantized import prepare_quant_kernel
from kvgate.kernels.cpu import quant as cpu_quant
from kvgate.kernels.quant_formats import QuantFormat
from tests.kernels.test_kernels_quant import random_blocks

CASES = [
    (QuantFormat.Q4_1, 3072, 576),  # SmolLM2's gate/up
    (QuantFormat.Q4_1, 576, 1536),  # its down projection
    (QuantFormat.Q8_0, 49152, 576),  # its LM head
    (QuantFormat.Q4_0, 3072, 576),
    (QuantFormat.Q4_K, 3072, 1024),
    (QuantFormat.Q5_K, 3072, 1024),
    (QuantFormat.Q6_K, 3072, 1024),
]


def best_cpu_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    best = []
    for _ in range(5):
        began = time.process_time()
        for _ in range(reps):
            fn()
        best.append((time.process_time() - began) / reps * 1e3)
    return min(best)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,32", help="rows of x, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = prepare_quant_kernel()
    print(loaded.log_line(), f"threads {args.threads}")
    if not cpu_quant.rows8_compiled(loaded):
        print("this build has no rows8 layout (it needs AVX2 and F16C)")
        return 1
    print("| format | W (rows x cols) | rows of x | stored ms | rows8 ms | ratio |")
    print("|---|---|---|---|---|---|")
    for fmt, rows, cols in CASES:
        data = random_blocks(fmt, rows, cols, seed=1)
        repacked = cpu_quant.repack_rows8(fmt, data)
        for n in (int(v) for v in args.rows.split(",")):
            x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
            reps = max(3, int(4e6 // (rows * cols * n)))
            stored = best_cpu_ms(
                partial(cpu_quant.quantized_matmul, x, fmt, data, cols, compiled=True), reps
            )
            rows8 = best_cpu_ms(
                partial(cpu_quant.quantized_matmul_rows8, x, fmt, repacked, cols, compiled=True),
                reps,
            )
            print(
                f"| {fmt.value} | {rows}x{cols} | {n} | {stored:.4f} | {rows8:.4f} | "
                f"{stored / rows8:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
