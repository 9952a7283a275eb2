"""Compile the Triton kernels for a CUDA GPU on a machine without one, and report resources.

    python -m kvgate.kernels.compile_check            # sm_90 (H100, H200), every variant
    python -m kvgate.kernels.compile_check --quick    # the few variants CI compiles

Runs Triton's whole pipeline (front end, MLIR passes, LLVM, then ptxas from the Triton wheel) for
the kernel variants the launchers pick for representative shapes, and prints registers, spill
bytes and shared memory of each. Exit status 1 when a variant fails to compile or a 16-bit
variant spills more than ``MAX_SPILL_BYTES`` per thread (float32 attention, IEEE products on CUDA
cores, may spill). Argument types and 16-divisibility hints are the ones Triton's JIT infers for
typical tensors.
``TRITON_INTERPRET`` must be unset: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgate.kernels.attention_config import (
    AttentionConfig,
    attention_constants,
    choose_config,
    next_power_of_2,
)
from kvgate.kernels.dispatch import triton_interpreting

H100_SM_COUNT = 132
# A few spilled bytes per thread stay in L1 and cost nothing measurable; hundreds in the inner
# loop do. 16-bit variants above this fail the check.
MAX_SPILL_BYTES = 64
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class AttentionCase:
    label: str
    num_tokens: int
    num_rows: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    large_cache: bool = False  # block strides past int32: passed as i64
    sliding_window: int | None = None
    logit_softcap: float | None = None

    def config(self) -> AttentionConfig:
        return choose_config(
            num_tokens=self.num_tokens,
            num_rows=self.num_rows,
            num_kv_heads=self.num_kv_heads,
            queries_per_kv=self.num_q_heads // self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            sm_count=H100_SM_COUNT,
        )


QUICK_CASES = [
    AttentionCase("prefill chunk 512, 32/8 heads, d128", 512, 1, 32, 8, 128, 16, torch.bfloat16),
    AttentionCase("decode batch 64, 8/2 heads, d80, bs 1", 64, 64, 8, 2, 80, 1, torch.float16),
    # Gemma 2's sliding layers: a window of 4096 positions and scores capped at 50.
    AttentionCase(
        "prefill 512, W 4096, cap 50, 8/4 h, d256",
        512,
        1,
        8,
        4,
        256,
        16,
        torch.bfloat16,
        sliding_window=4096,
        logit_softcap=50.0,
    ),
]
FULL_CASES = [
    *QUICK_CASES,
    AttentionCase("prefill 8 chunks, 32/8 heads, d128", 4096, 8, 32, 8, 128, 16, torch.bfloat16),
    AttentionCase("decode batch 1, 32/8 heads, d128", 1, 1, 32, 8, 128, 16, torch.bfloat16),
    AttentionCase("decode batch 256, 32/8 heads, d128", 256, 256, 32, 8, 128, 64, torch.bfloat16),
    AttentionCase("decode, cache > 2**31 elements", 64, 64, 32, 8, 128, 16, torch.bfloat16, True),
    AttentionCase("prefill 16/1 heads (MQA), d96", 2048, 4, 16, 1, 96, 32, torch.float16),
    AttentionCase("prefill 8/4 heads, d256", 2048, 4, 8, 4, 256, 16, torch.bfloat16),
    AttentionCase("decode 12/2 heads (group 6), d64", 32, 32, 12, 2, 64, 8, torch.bfloat16),
    AttentionCase("mixed fp32, 8/2 heads, d128", 300, 20, 8, 2, 128, 16, torch.float32),
    AttentionCase(
        "decode 64, W 4096, cap 50, 8/4 h, d256",
        64,
        64,
        8,
        4,
        256,
        16,
        torch.bfloat16,
        sliding_window=4096,
        logit_softcap=50.0,
    ),
    AttentionCase(
        "prefill 8 chunks, W 1024, 32/8 h, d128",
        4096,
        8,
        32,
        8,
        128,
        16,
        torch.bfloat16,
        sliding_window=1024,
    ),
]


@dataclass(frozen=True)
class ExpertsCase:
    """One launch of the fused experts (``triton_moe``): its config follows from these."""

    label: str
    num_pairs: int  # tokens x top-k
    num_experts: int
    top_k: int
    dtype: torch.dtype


QUICK_EXPERTS_CASES = [ExpertsCase("experts decode 1 x top-8 of 128", 8, 128, 8, torch.bfloat16)]
FULL_EXPERTS_CASES = [
    *QUICK_EXPERTS_CASES,
    ExpertsCase("experts prefill 300 x top-8 of 64", 2400, 64, 8, torch.float16),
    ExpertsCase("experts prefill 2048 x top-2 of 8", 4096, 8, 2, torch.bfloat16),
    ExpertsCase("experts fp32 256 x top-2 of 8", 512, 8, 2, torch.float32),
]


def _signature(kernel: Any, pointer_types: dict[str, str], i64_names: set[str]) -> dict[str, str]:
    signature = {}
    for name in kernel.arg_names:
        if name in pointer_types:
            signature[name] = pointer_types[name]
        elif name.startswith("stride_") or name == "num_rows":
            signature[name] = "i64" if name in i64_names else "i32"
        elif name == "scale_log2":
            signature[name] = "fp32"
    return signature


def _compile(
    kernel: Any,
    *,
    signature: dict[str, str],
    constants: dict[str, Any],
    arch: int,
    num_warps: int,
    num_stages: int,
) -> tuple[int, int, int]:
    """Compile one variant; return (registers, spill bytes, shared memory bytes)."""
    # Triton is imported only after main() has checked TRITON_INTERPRET (it fixes the mode).
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    names = kernel.arg_names
    # The JIT marks 16-aligned pointers and integers divisible by 16 (all strides of the caches
    # it is given in practice, but not a block table's row stride) with this hint.
    hinted = [
        n
        for n, t in signature.items()
        if t.startswith("*") or (n.startswith("stride_") and n != "stride_table_row")
    ]
    source = ASTSource(
        fn=kernel,
        signature={**signature, **dict.fromkeys(constants, "constexpr")},
        constexprs=constants,
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in hinted},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name}", str(ptx), "-o", f"{ptx}.o"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", report))
    return registers, spills, int(compiled.metadata.shared)


def check_attention(case: AttentionCase, arch: int) -> bool:
    from kvgate.kernels import triton_attention  # noqa: PLC0415 - after the mode check

    config = case.config()
    constants = attention_constants(
        config=config,
        head_dim=case.head_dim,
        block_size=case.block_size,
        queries_per_kv=case.num_q_heads // case.num_kv_heads,
        dtype=case.dtype,
        sliding_window=case.sliding_window,
        logit_softcap=case.logit_softcap,
    )
    element = "*" + _TRITON_TYPES[case.dtype]
    pointers = dict.fromkeys(("out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"), element)
    pointers |= dict.fromkeys(("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"), "*i32")
    pointers |= {"split_out_ptr": "*fp32", "split_lse_ptr": "*fp32"}
    wide = {"stride_kc_block", "stride_vc_block"} if case.large_cache else set()
    signature = _signature(triton_attention._paged_attention_kernel, pointers, wide)
    registers, spills, shared = _compile(
        triton_attention._paged_attention_kernel,
        signature=signature,
        constants=dict(constants),
        arch=arch,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    print(
        f"{case.label:<42} {config}\n{'':<42} registers {registers}, spills {spills} B, "
        f"shared {shared} B",
        flush=True,
    )
    return spills <= MAX_SPILL_BYTES or case.dtype == torch.float32


def check_helpers(arch: int) -> bool:
    from kvgate.kernels import triton_attention, triton_cache  # noqa: PLC0415 - as above

    wide = {"stride_kc_block", "stride_vc_block"}
    variants: list[tuple[str, Any, dict[str, str], dict[str, Any], int]] = [
        (
            "merge splits",
            triton_attention._merge_splits_kernel,
            {"out_ptr": "*bf16", "split_out_ptr": "*fp32", "split_lse_ptr": "*fp32"},
            {"HEAD_DIM": 80, "HEAD_DIM_PAD": 128, "NUM_SPLITS": 7, "SPLITS_PAD": 8},
            4,
        ),
        (
            "write_kv",
            triton_cache._write_kv_kernel,
            dict.fromkeys(("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"), "*bf16")
            | {"slot_mapping_ptr": "*i64"},
            {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16},
            1,
        ),
        (
            "copy_slots",
            triton_cache._copy_slots_kernel,
            {"key_cache_ptr": "*fp16", "value_cache_ptr": "*fp16"}
            | {"src_slots_ptr": "*i64", "dst_slots_ptr": "*i64"},
            {"HEAD_DIM": 96, "HEAD_DIM_PAD": next_power_of_2(96), "BLOCK_SIZE": 16},
            1,
        ),
    ]
    ok = True
    for label, kernel, pointers, constants, num_warps in variants:
        registers, spills, shared = _compile(
            kernel,
            signature=_signature(kernel, pointers, wide),
            constants=constants,
            arch=arch,
            num_warps=num_warps,
            num_stages=1,
        )
        print(f"{label:<42} registers {registers}, spills {spills} B, shared {shared} B")
        ok &= spills <= MAX_SPILL_BYTES
    return ok


def check_experts(case: ExpertsCase, arch: int) -> bool:
    """Both kernels of one fused-experts launch (gate/up with the activation, then down)."""
    from kvgate.kernels import triton_moe  # noqa: PLC0415 - after the mode check

    config = triton_moe.choose_experts_config(
        case.num_pairs, case.num_experts, case.dtype, interpreted=False
    )
    element = "*" + _TRITON_TYPES[case.dtype]
    shared_types = {"pair_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
    shared_types |= dict.fromkeys(("num_pairs", "num_experts", "hidden", "inter"), "i32")
    constants = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "DOT_PRECISION": triton_moe.dot_precision(case.dtype),
    }
    kernels: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = [
        (
            "gate/up",
            triton_moe._expert_gate_up_kernel,
            dict.fromkeys(("x_ptr", "gate_up_ptr", "act_ptr"), element),
            {"TOP_K": case.top_k},
        ),
        (
            "down",
            triton_moe._expert_down_kernel,
            dict.fromkeys(("act_ptr", "down_ptr"), element)
            | {"pair_out_ptr": "*fp32", "topk_weights_ptr": "*fp32"},
            {},
        ),
    ]
    ok = True
    for part, kernel, pointers, extra in kernels:
        types = _signature(kernel, pointers, set()) | shared_types
        registers, spills, shared = _compile(
            kernel,
            signature={name: types[name] for name in kernel.arg_names if name in types},
            constants=constants | extra,
            arch=arch,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        print(
            f"{case.label + ', ' + part:<42} {config}\n{'':<42} registers {registers}, "
            f"spills {spills} B, shared {shared} B",
            flush=True,
        )
        ok &= spills <= MAX_SPILL_BYTES or case.dtype == torch.float32
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument("--quick", action="store_true", help="only the variants CI compiles")
    args = parser.parse_args(argv)
    if triton_interpreting():
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    ok = True
    for case in QUICK_CASES if args.quick else FULL_CASES:
        ok &= check_attention(case, args.arch)
    ok &= check_helpers(args.arch)
    for experts in QUICK_EXPERTS_CASES if args.quick else FULL_EXPERTS_CASES:
        ok &= check_experts(experts, args.arch)
    print("all variants compiled" + ("" if ok else "; some 16-bit variant spills registers"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
