"""The experts of one MoE layer on CPU float32: the executor's path against the alternatives.

    python benchmarks/bench_moe_cpu.py               # 1 thread
    python benchmarks/bench_moe_cpu.py --threads 2

Every variant computes ``sum_j w_j * expert[ids_j](x)`` for the same routing (softmax, top-k,
renormalised) and is checked against the specification before it is timed (best of N):

  packed-sorted     the executor (kvgate.executor.moe): pairs sorted by expert, each expert's
                    rows through its oneDNN-packed linears, slots summed after weighting
  packed-index-add  the same linears, rows gathered per expert with index_select, index_add_
  flinear-sorted    pairs sorted, F.linear on the stacked [E, 2I, H] / [E, H, I] weights
  reference         kvgate.kernels.torch_moe.fused_experts_reference (torch.where per expert)
  bmm-gather        every pair's expert weights gathered for one bmm (small batches only)

Shapes: H 1024 with E 64, k 8, I 512 (fine-grained experts, Qwen3-MoE-like) and E 8, k 2,
I 2048 (Mixtral-like); tokens 1 to 256.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.executor.layer_ops import select_layer_ops
from kvgate.executor.linear import Linear, LinearBackend, select_linear_backend
from kvgate.executor.moe import MoeWeights, PackedExperts, route
from kvgate.kernels.torch_moe import fused_experts_reference

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SHAPES = [(1024, 512, 64, 8), (1024, 2048, 8, 2)]  # (H, I, E, k)
TOKENS = [1, 4, 16, 64, 256]


def _sorted_flinear(gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        order = torch.argsort(ids.reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=gate_up.shape[0]).tolist()
        xs = x.index_select(0, order // k)
        ys = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            gate, up = F.linear(xs[start : start + c], gate_up[e]).chunk(2, dim=-1)
            ys[start : start + c] = F.linear(F.silu(gate) * up, down[e])
            start += c
        pair_out = torch.empty_like(ys).index_copy_(0, order, ys)
        return (pair_out.view(n, k, -1) * weights.unsqueeze(-1)).sum(1)

    return run


def _packed_index_add(gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
    packed_gate_up = [Linear.build(w, None, LinearBackend.ONEDNN) for w in gate_up]
    packed_down = [Linear.build(w, None, LinearBackend.ONEDNN) for w in down]

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(len(packed_down)):
            tokens, slots = torch.where(ids == e)
            if tokens.numel():
                gate, up = packed_gate_up[e](x.index_select(0, tokens)).chunk(2, dim=-1)
                y = packed_down[e](F.silu(gate) * up) * weights[tokens, slots, None]
                out.index_add_(0, tokens, y)
        return out

    return run


def _bmm_gather(gate_up: torch.Tensor, down: torch.Tensor) -> Experts:
    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(k, 0).unsqueeze(1)
        gate, up = torch.bmm(rows, gate_up[flat].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), down[flat].transpose(1, 2)).squeeze(1)
        return (y.view(n, k, -1) * weights.unsqueeze(-1)).sum(1)

    return run


def _reference(
    gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return fused_experts_reference(x, gate_up, down, w, ids)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    if select_linear_backend(cpu, torch.float32) is not LinearBackend.ONEDNN:
        sys.exit("this torch has no oneDNN: the executor would take the reference path")
    ops = select_layer_ops(cpu, torch.float32)
    generator = torch.Generator().manual_seed(0)
    for hidden, inter, num_experts, top_k in SHAPES:
        gate_up = 0.02 * torch.randn(num_experts, 2 * inter, hidden, generator=generator)
        down = 0.02 * torch.randn(num_experts, hidden, inter, generator=generator)
        router = torch.randn(num_experts, hidden, generator=generator)
        weights = MoeWeights(router, gate_up, down, None)
        variants: dict[str, Experts] = {
            "packed-sorted": PackedExperts(weights, LinearBackend.ONEDNN, ops, False),
            "packed-index-add": _packed_index_add(gate_up, down),
            "flinear-sorted": _sorted_flinear(gate_up, down),
            "reference": partial(_reference, gate_up, down),
            "bmm-gather": _bmm_gather(gate_up, down),
        }
        print(f"H {hidden}, I {inter}, E {num_experts}, k {top_k}, {args.threads} thread(s): ms")
        print(f"{'tokens':>8}" + "".join(f"{name:>18}" for name in variants))
        for num_tokens in TOKENS:
            x = torch.randn(num_tokens, hidden, generator=generator)
            topk_weights, topk_ids = route(x @ router.T, top_k, normalize=True)
            expected = fused_experts_reference(x, gate_up, down, topk_weights, topk_ids)
            row = f"{num_tokens:>8}"
            for name, run in variants.items():
                if name == "bmm-gather" and num_tokens > 16:
                    row += f"{'-':>18}"
                    continue
                got = run(x, topk_weights, topk_ids)
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
                repeats = 5 if num_tokens >= 64 else 10
                call = partial(run, x, topk_weights, topk_ids)
                row += f"{_best_ms(call, repeats):>18.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
