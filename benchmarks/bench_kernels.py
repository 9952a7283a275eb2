"""Paged attention throughput against dense attention on the same data, measured in one run.

    python benchmarks/bench_kernels.py            # GPU if there is one, else the CPU torch path
    python benchmarks/bench_kernels.py --sweep    # plus alternative launch configs on a few cases
    python benchmarks/bench_kernels.py --window   # CPU: a small sliding window over a long context

For each case the K/V live in a paged cache (block_size 16, shuffled blocks, the executor's 5-D
layout viewed per layer) and the same values are laid out contiguously for the baselines:
``torch.nn.functional.scaled_dot_product_attention`` (GQA without copying heads where the
installed torch supports it) and flash-attn's varlen kernel when ``flash_attn`` is importable.

Figures:
  TFLOP/s  4 * head_dim * num_q_heads * (query, key) pairs actually visible under the causal mask
  GB/s     bytes that must cross HBM at least once: K and V of every row, the queries, the output
  ratio    our throughput / baseline throughput (same work, so baseline time / our time)
  %peak    GB/s / the device's peak HBM bandwidth (decode is bandwidth-bound)

Goals on an H200: prefill >= 0.6x SDPA, decode >= 50% of peak HBM bandwidth at batch >= 32 and
context >= 4k. On a machine without CUDA the script times kvgate's vectorized torch CPU path (the
path the CPU executor uses; not the Triton kernel) against SDPA on CPU with small shapes, and
says so in its output: those numbers say nothing about the GPU kernel.

``--window`` times the CPU paths (the compiled kernel of ``kvgate.kernels.cpu`` and the torch
path) on a long context with ``sliding_window`` against full causal attention over the same
context in the same run. Goal: a window of W positions costs about the window, so the ratio
full / windowed approaches context / W (decode) or (context + q / 2) / W (a prefill chunk of q
queries).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate import kernels

if TYPE_CHECKING:
    from kvgate.kernels.triton_attention import AttentionConfig

# Peak HBM bandwidth in bytes/s by device-name fragment (vendor datasheets).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" or "decode"
    num_rows: int
    q_len: int  # new tokens per row
    context: int  # prior context per row (seq_len = context + q_len)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len

    def label(self) -> str:
        heads = f"{self.num_q_heads}/{self.num_kv_heads}h"
        if self.kind == "prefill":
            return f"prefill {self.num_rows}x{self.q_len} ctx {self.context} {heads}"
        return f"decode batch {self.num_rows} ctx {self.seq_len} {heads}"

    def flops(self) -> float:
        pairs = self.q_len * self.context + self.q_len * (self.q_len + 1) / 2
        return 4.0 * self.head_dim * self.num_q_heads * pairs * self.num_rows

    def bytes_moved(self, element_size: int) -> float:
        kv = 2 * self.seq_len * self.num_kv_heads * self.head_dim
        q_and_out = 2 * self.q_len * self.num_q_heads * self.head_dim
        return float(element_size * self.num_rows * (kv + q_and_out))


@dataclass
class Inputs:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # per-layer view [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    dense_q: torch.Tensor  # [num_rows, num_q_heads, q_len, head_dim]
    dense_k: torch.Tensor  # [num_rows, num_kv_heads, seq_len, head_dim]
    dense_v: torch.Tensor
    scale: float


def gpu_cases() -> list[Case]:
    cases = [
        Case("prefill", rows, 512, context, heads, heads // 4)
        for heads in (8, 32)
        for rows in (1, 8)
        for context in (0, 4096, 16384)
    ]
    for batch in (1, 8, 32, 64, 128, 256):
        for context in (1024, 4096, 16384, 32768):
            if batch * context <= 2**21:  # K+V of a case stay within ~8 GB per copy
                cases.append(Case("decode", batch, 1, context - 1, 32, 8))
    return cases


def cpu_cases() -> list[Case]:
    return [
        Case("prefill", 1, 128, 0, 8, 2),
        Case("prefill", 1, 128, 512, 8, 2),
        Case("decode", 1, 1, 1023, 8, 2),
        Case("decode", 16, 1, 1023, 8, 2),
        Case("decode", 64, 1, 255, 8, 2),
    ]


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, layers: int = 2) -> Inputs:
    """Paged cache (shuffled blocks, layer 1 of a 5-D cache) and the same data densely."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_row = math.ceil(case.seq_len / BLOCK_SIZE)
    num_blocks = case.num_rows * blocks_per_row
    kv_shape = (case.num_rows, case.num_kv_heads, case.seq_len, case.head_dim)
    dense_k = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    dense_v = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    dense_q = torch.randn(
        (case.num_rows, case.num_q_heads, case.q_len, case.head_dim),
        generator=gen,
        device=device,
        dtype=dtype,
    )
    cache_shape = (num_blocks, layers, BLOCK_SIZE, case.num_kv_heads, case.head_dim)
    key_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    value_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = order.view(case.num_rows, blocks_per_row).to(torch.int32)
    # Write the dense K/V into the cache through kvgate's own write_kv (slot per position).
    positions = torch.arange(case.seq_len, device=device)
    slots = tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    kernels.write_kv(
        dense_k.permute(0, 2, 1, 3).reshape(-1, case.num_kv_heads, case.head_dim),
        dense_v.permute(0, 2, 1, 3).reshape(-1, case.num_kv_heads, case.head_dim),
        key_cache[:, 1],
        value_cache[:, 1],
        slots.reshape(-1),
    )
    query = dense_q.permute(0, 2, 1, 3).reshape(-1, case.num_q_heads, case.head_dim).contiguous()
    starts = torch.arange(case.num_rows + 1, device=device, dtype=torch.int32) * case.q_len
    return Inputs(
        query=query,
        key_cache=key_cache[:, 1],
        value_cache=value_cache[:, 1],
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.full((case.num_rows,), case.seq_len, device=device, dtype=torch.int32),
        dense_q=dense_q,
        dense_k=dense_k,
        dense_v=dense_v,
        scale=case.head_dim**-0.5,
    )


def sdpa_fn(case: Case, inp: Inputs) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA on the dense tensors, bottom-right causal; GQA natively if torch allows it."""
    from torch.nn.attention.bias import causal_lower_right

    if case.q_len == 1:
        mask, causal = None, False  # one query sees the whole context
    elif case.context == 0:
        mask, causal = None, True
    else:
        mask, causal = causal_lower_right(case.q_len, case.seq_len), False

    def native() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            inp.dense_q,
            inp.dense_k,
            inp.dense_v,
            attn_mask=mask,
            is_causal=causal,
            scale=inp.scale,
            enable_gqa=True,
        )

    try:
        native()
        return native, "sdpa(gqa)"
    except (RuntimeError, TypeError, NotImplementedError):
        group = case.num_q_heads // case.num_kv_heads
        k = inp.dense_k.repeat_interleave(group, dim=1)
        v = inp.dense_v.repeat_interleave(group, dim=1)

        def expanded() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                inp.dense_q, k, v, attn_mask=mask, is_causal=causal, scale=inp.scale
            )

        return expanded, "sdpa(heads copied)"


def flash_fn(case: Case, inp: Inputs) -> Callable[[], torch.Tensor] | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    q = inp.query
    k = inp.dense_k.permute(0, 2, 1, 3).reshape(-1, case.num_kv_heads, case.head_dim)
    v = inp.dense_v.permute(0, 2, 1, 3).reshape(-1, case.num_kv_heads, case.head_dim)
    cu_k = torch.arange(case.num_rows + 1, device=q.device, dtype=torch.int32) * case.seq_len

    def run() -> torch.Tensor:
        return flash_attn_varlen_func(
            q,
            k,
            v,
            inp.query_start_loc,
            cu_k,
            case.q_len,
            case.seq_len,
            softmax_scale=inp.scale,
            causal=True,
        )

    return run


def kvgate_fn(inp: Inputs, config: AttentionConfig | None = None) -> Callable[[], torch.Tensor]:
    out = torch.empty_like(inp.query)
    args = (
        inp.query,
        inp.key_cache,
        inp.value_cache,
        inp.block_tables,
        inp.query_start_loc,
        inp.seq_lens,
        inp.scale,
    )
    if config is None:
        return lambda: kernels.paged_attention(*args, out=out)
    from kvgate.kernels import triton_attention

    return lambda: triton_attention.paged_attention_triton(*args, out=out, config=config)


def time_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_bandwidth(device: torch.device, override_gbs: float | None) -> float | None:
    if override_gbs is not None:
        return override_gbs * 1e9
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


# Representative cases for --sweep (each config compiles once: minutes for the whole sweep).
SWEEP_CASES = {
    Case("prefill", 1, 512, 4096, 32, 8),
    Case("prefill", 8, 512, 0, 8, 2),
    Case("decode", 32, 1, 4095, 32, 8),
    Case("decode", 128, 1, 16383, 32, 8),
    Case("decode", 1, 1, 32767, 32, 8),
}


def sweep_configs(case: Case) -> list[AttentionConfig]:
    from kvgate.kernels.triton_attention import AttentionConfig

    if case.kind == "decode":
        return [
            AttentionConfig(16, tile, splits, 4, stages)
            for tile in (32, 64, 128)
            for splits in (1, 2, 4, 8, 16)
            for stages in (2, 3)
        ]
    return [
        AttentionConfig(block_m, tile, splits, warps, stages)
        for block_m, tile in ((64, 32), (64, 64), (128, 32), (128, 64))
        for warps in (4, 8)
        for stages in (2, 3)
        for splits in (1, 4)
    ]


@dataclass(frozen=True)
class WindowCase:
    base: Case
    sliding_window: int

    def label(self) -> str:
        return f"{self.base.label()}, W {self.sliding_window}"

    def work_ratio(self) -> float:
        """Query-key pairs under full causal over those inside the window."""
        q, context, window = self.base.q_len, self.base.context, self.sliding_window
        full = q * context + q * (q + 1) / 2
        windowed = sum(min(window, context + i + 1) for i in range(q))
        return full / windowed


WINDOW_CASES = [
    WindowCase(Case("decode", 8, 1, 16383, 8, 2), 1024),
    WindowCase(Case("decode", 8, 1, 16383, 8, 2), 256),
    WindowCase(Case("prefill", 1, 128, 8064, 8, 2), 1024),
]


def run_window_cases() -> None:
    """Full causal against a sliding window on the same paged inputs, CPU, in one run."""
    from kvgate.executor.layer_ops import prepare_cpu_kernels

    loaded = prepare_cpu_kernels()
    print(loaded.log_line())
    device = torch.device("cpu")
    columns = ["case", "path", "full causal ms", "window ms", "ratio", "work ratio"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)
    for case in WINDOW_CASES:
        inp = make_inputs(case.base, torch.float32, device)
        args = (
            inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.query_start_loc,
            inp.seq_lens, inp.scale,
        )  # fmt: skip
        outputs = {}
        for path, compiled in (("compiled", True), ("torch", False)):
            if compiled and not loaded.compiled:
                continue
            ms = {}
            for window in (None, case.sliding_window):
                plan = kernels.plan_attention(
                    inp.block_tables, inp.query_start_loc, inp.seq_lens,
                    num_tokens=inp.query.shape[0], num_blocks=inp.key_cache.shape[0],
                    block_size=BLOCK_SIZE, compiled=compiled, sliding_window=window,
                )  # fmt: skip
                out = torch.empty_like(inp.query)

                run = functools.partial(
                    kernels.paged_attention, *args, out=out, plan=plan, sliding_window=window
                )
                outputs[path, window] = run().clone()
                ms[window] = time_ms(run, device)
            full, windowed = ms[None], ms[case.sliding_window]
            print(
                f"| {case.label()} | {path} | {full:.2f} | {windowed:.2f} | "
                f"{full / windowed:.1f}x | {case.work_ratio():.1f}x |",
                flush=True,
            )
        # Same answer first: the paths agree with each other under the window.
        if ("compiled", case.sliding_window) in outputs:
            torch.testing.assert_close(
                outputs["compiled", case.sliding_window],
                outputs["torch", case.sliding_window],
                atol=1e-4,
                rtol=1e-4,
            )
        del inp


def run_case(
    case: Case, dtype: torch.dtype, device: torch.device, peak: float | None, sweep: bool
) -> None:
    inp = make_inputs(case, dtype, device)
    ours = kvgate_fn(inp)
    sdpa, sdpa_name = sdpa_fn(case, inp)
    # Same answer first: a fast wrong kernel is not a result.
    reference = sdpa().transpose(1, 2).reshape(inp.query.shape)
    torch.testing.assert_close(ours().float(), reference.float(), atol=3e-2, rtol=3e-2)
    ours_ms = time_ms(ours, device)
    sdpa_ms = time_ms(sdpa, device)
    flops, moved = case.flops(), case.bytes_moved(inp.query.element_size())
    cells = [
        case.label(),
        f"{ours_ms:.3f}",
        f"{flops / ours_ms / 1e9:.3g}",
        f"{moved / ours_ms / 1e6:.4g}",
        "-" if peak is None else f"{100 * moved / (ours_ms * 1e-3) / peak:.1f}%",
        f"{sdpa_ms:.3f} {sdpa_name}",
        f"{sdpa_ms / ours_ms:.2f}x",
    ]
    flash = flash_fn(case, inp) if device.type == "cuda" else None
    if flash is not None:
        flash_ms = time_ms(flash, device)
        cells += [f"{flash_ms:.3f}", f"{flash_ms / ours_ms:.2f}x"]
    line = "| " + " | ".join(cells) + " |"
    print(line, flush=True)
    if sweep and device.type == "cuda" and case in SWEEP_CASES:
        results = []
        for config in sweep_configs(case):
            try:
                results.append((time_ms(kvgate_fn(inp, config), device), config))
            except Exception as error:  # a config the compiler rejects (e.g. shared memory)
                print(f"    config {config} failed: {type(error).__name__}", flush=True)
        results.sort(key=lambda item: item[0])
        for ms, config in results[:3]:
            print(f"    sweep {ms:8.3f} ms ({ours_ms / ms:4.2f}x of default) {config}", flush=True)
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument(
        "--sweep", action="store_true", help="also time alternative configs on SWEEP_CASES (GPU)"
    )
    parser.add_argument("--only", choices=["prefill", "decode"], help="run one kind of case")
    parser.add_argument("--peak-gbs", type=float, help="peak HBM bandwidth in GB/s")
    parser.add_argument(
        "--window", action="store_true", help="CPU: sliding window against full causal, then exit"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.window:
        print(f"device: CPU, {torch.get_num_threads()} threads; fp32; torch {torch.__version__}")
        run_window_cases()
        return 0
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; kvgate Triton kernels; {args.dtype}")
        cases = gpu_cases()
        assert SWEEP_CASES.issubset(cases), "every sweep case must be a benchmarked case"
    else:
        dtype = torch.float32  # CPU matmuls in 16-bit are emulated and meaningless here
        print(
            "device: CPU (no CUDA). Timing kvgate's vectorized torch CPU path, NOT the Triton "
            "kernel, against SDPA on CPU; fp32, small shapes. These are not GPU figures."
        )
        cases = cpu_cases()
    peak = peak_bandwidth(device, args.peak_gbs)
    print(
        f"torch {torch.__version__}; peak HBM bandwidth: "
        f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}"
    )
    columns = ["case", "ours ms", "TFLOP/s", "GB/s", "% peak BW", "baseline ms", "ratio"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        columns += ["flash-attn ms", "ratio"]
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    print(header, flush=True)
    for case in cases:
        if args.only is None or case.kind == args.only:
            run_case(case, dtype, device, peak, args.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
