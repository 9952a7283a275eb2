"""Tensor parallelism on one multi-GPU machine: NCCL equality, then decode/prefill scaling.

1. Equality: a small random fp32 model (8 query and 8 KV heads) generates greedily on 1 rank and
   on every world size asked for; the tokens must be identical (exit 1 otherwise).
2. Scaling: a 1B-class random bf16 model (32 query / 8 KV heads, 16 layers): one prefill step of
   ``--batch`` prompts of ``--prompt`` tokens, then ``--decode-steps`` decode steps; the table
   shows the prefill step, the median decode step and decode tokens/s per world size.

Each world size runs as its own ranks (``--rank`` mode of this script), meeting on 127.0.0.1 the
way ``kvgate executor --tensor-parallel-size N`` does.

    PYTHONPATH=. python benchmarks/bench_tensor_parallel.py [--world-sizes 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.executor.tensor_parallel.ranks import (
    RankSpec,
    TensorParallelExecutor,
    build_rank_executor,
    follow,
    join_group,
)
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType, ModelFamily

EQUALITY = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=4099, hidden_size=512, num_layers=4, num_heads=8,
    num_kv_heads=8, tokenizer=False, seed=4,
)  # fmt: skip
SCALING = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=5632,
    num_layers=16, num_heads=32, num_kv_heads=8, tokenizer=False, dtype="bfloat16",
    max_position_embeddings=8192,
)  # fmt: skip
BLOCK_SIZE = 16


def _plans(batch: int, prompt: int, steps: int, vocab: int) -> list[wire.StepPlan]:
    pages = -(-(prompt + steps + 1) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(batch)]
    first = wire.StepPlan(
        step_id=1,
        new_requests=[
            wire.NewRequest(
                request_id=rid,
                prompt_token_ids=torch.randint(vocab, (prompt,), generator=gen).tolist(),
                sampling=wire.SamplingParams(max_tokens=steps + 1, ignore_eos=True),
            )
            for rid in ids
        ],
        block_appends=[
            wire.BlockAppend(request_id=rid, new_block_ids=[list(range(start, start + pages))])
            for rid, start in zip(ids, range(0, batch * pages, pages), strict=True)
        ],
        prefill_rows=[
            wire.PrefillRow(
                request_id=rid, token_start=0, token_end=prompt, depth_first=1, depth_last=1,
                completes_fill=True,
            )
            for rid in ids
        ],
    )  # fmt: skip
    decode = wire.DecodeRows(request_ids=ids, positions=[None] * batch, depths=[None] * batch)
    return [first] + [wire.StepPlan(step_id=2 + s, decode=decode) for s in range(steps)]


def _drive(
    backend: Executor | TensorParallelExecutor, plans: list[wire.StepPlan]
) -> dict[str, Any]:
    times, tokens = [], []
    for plan in plans:
        began = time.perf_counter()
        result = backend.execute(plan)  # sampling reads the logits back: the step has finished
        times.append(time.perf_counter() - began)
        if result.error is not None:
            raise SystemExit(f"step {plan.step_id}: {result.error.message}")
        tokens.append([t.token_id for t in result.sampled_tokens()])
    return {"prefill_s": times[0], "decode_s": times[1:], "tokens": tokens}


def run_rank(args: argparse.Namespace) -> int:
    dtype = DType(args.dtype)
    batch, prompt, steps = args.batch, args.prompt, args.decode_steps
    num_blocks = batch * (-(-(prompt + steps + 1) // BLOCK_SIZE)) + 1
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    plans = _plans(batch, prompt, steps, vocab)
    if args.world == 1:
        loaded = load_model(args.model, device=args.device, dtype=dtype)
        backend: Executor | TensorParallelExecutor = Executor(
            loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE
        )
    else:
        spec = RankSpec(
            rank=args.rank, world_size=args.world, master_port=args.port, model=args.model,
            device=args.device, dtype=dtype, num_blocks=num_blocks, block_size=BLOCK_SIZE,
        )  # fmt: skip
        parallel, channel = join_group(spec)
        executor = build_rank_executor(spec, parallel)
        if args.rank != 0:
            follow(executor, channel)
            return 0
        backend = TensorParallelExecutor(executor, channel)
    _drive(backend, plans[:3])  # warm-up: first launches, allocator
    backend.reset()
    outcome = _drive(backend, plans)
    if isinstance(backend, TensorParallelExecutor):
        backend.stop()
    args.out.write_text(json.dumps(outcome))
    return 0


def _launch(world: int, model: Path, dtype: str, out: Path, args: argparse.Namespace) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = [
        "--model", str(model), "--dtype", dtype, "--world", str(world), "--port", str(port),
        "--out", str(out), "--batch", str(args.batch), "--prompt", str(args.prompt),
        "--decode-steps", str(args.decode_steps),
    ]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(rank), *common])
        for rank in range(world)
    ]
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    if any(codes):
        raise SystemExit(f"world size {world}: rank exit codes {codes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run
    args = parser.parse_args()
    if args.rank is not None:
        return run_rank(args)
    visible = torch.cuda.device_count()
    worlds = [w for w in map(int, args.world_sizes.split(",")) if w <= visible]
    print(f"{visible} GPU(s): {torch.cuda.get_device_name(0) if visible else 'none'}; "
          f"world sizes {worlds}")  # fmt: skip
    if len(worlds) < 2:
        print("needs at least two GPUs")
        return 1
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        small = make_tiny_model(root / "equality", EQUALITY)
        big = make_tiny_model(root / "scaling", SCALING)
        runs: dict[int, dict[str, Any]] = {}
        for world in worlds:
            _launch(world, small, "float32", root / f"eq-{world}.json", args)
            runs[world] = json.loads((root / f"eq-{world}.json").read_text())
            same = runs[world]["tokens"] == runs[worlds[0]]["tokens"]
            status |= not same
            print(f"equality fp32, world {world}: {'identical' if same else 'DIFFERENT'} tokens")
        print("| world | prefill step (ms) | decode step median (ms) | decode tok/s | speed-up |")
        print("|---|---|---|---|---|")
        base = None
        for world in worlds:
            _launch(world, big, "bfloat16", root / f"sc-{world}.json", args)
            run = json.loads((root / f"sc-{world}.json").read_text())
            step = statistics.median(run["decode_s"])
            base = base or step
            print(f"| {world} | {run['prefill_s'] * 1e3:.1f} | {step * 1e3:.2f} | "
                  f"{args.batch / step:.0f} | {base / step:.2f}x |")  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
