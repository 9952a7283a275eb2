"""The interactive path's own cost: added time to first token and inter-token gaps, per request,
against the executor's own timings, on the embedded broker and on real Kafka, for two trees.

    python benchmarks/bench_interactive.py [--baseline REV] [--tree REV] [--kafka local,real]
        [--requests N] [--max-tokens M] [--tiny-words | --tiny | --model-dir DIR]

Per request (streamed ``/v1/completions``, one at a time, greedy, ``ignore_eos``):

- TTFT: the request sent → the stream's response headers (the gateway opens the stream at the
  first token, in every version);
- the executor's own time to the first token: the executor's ``execute_s`` summed over the
  steps that prefilled the request (the admission service's ``kvgate.step.round_trip`` spans,
  ``kvgate.step.prefill_ids`` and ``kvgate.step.execute_s``, from its spans file);
- added TTFT = TTFT minus that: HTTP, Kafka both ways, intake, scheduling, the outbox, the
  gateway — everything but the model;
- inter-token gaps: between the stream's text events (a token whose text is held back, such as
  half a UTF-8 character, joins the next event), with the share under 1 ms ("bunched": tokens
  released together, the sign of a beat) and the executor's median decode step for reference.

Brokers: ``local`` is ``kvgate run`` (the embedded Tansu broker, the gateway in the same
process); ``real`` is Apache Kafka 4.4 from the test harness (``tests/harness``: Docker, the
image built once) with ``kvgate executor``, ``kvgate admission-service`` (transactions on)
and ``kvgate gateway`` as separate processes, each tree with its own defaults.

Trees: each revision is checked out with ``git worktree add`` into a temporary directory and
run from there (``PYTHONPATH``), so the working tree's uncommitted edits never leak into a
figure; the worktrees are removed at the end. ``--tree`` defaults to ``HEAD``; with
``--baseline`` both trees run in each broker, alternating which goes first by round.

The model is the packaged SmolLM2-135M-Instruct (real text, so nearly every token is its own
event) at one executor thread. ``--tiny-words`` is the tiny random model with a word tokenizer
(``tests/admission_service/word_tokenizers.py``: every token id a word, so every token is an
event of its own) whose steps take a few milliseconds: a beat of the commit cycle shows
plainly in its gaps, where SmolLM2's steps on a loaded machine hide it. ``--tiny`` has the byte
tokenizer: its random bytes are mostly held back as incomplete characters, so its gaps say
little. The machine is shared: read the figures with
the load printed next to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvgate.local.stack import free_port  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# Two tokens this close arrived in one read: released together (the sign of a beat).
BUNCHED_S = 0.001
READY_TIMEOUT_S = 300.0


# ------------------------------------------------------------------------------------- trees


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out (detached) in a temporary directory, removed afterwards; ``.`` is
    this checkout as it is, uncommitted edits included (for trying a change before it is
    committed: never for a recorded figure)."""
    if rev == ".":
        yield REPO
        return
    path = Path(tempfile.mkdtemp(prefix="kvgate-bench-tree-"))
    path.rmdir()
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
            check=False, capture_output=True,
        )  # fmt: skip


def tree_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    return env | {"PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def kvgate(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvgate", *argv]


def start(argv: list[str], tree: Path, log: Path, **env: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        return subprocess.Popen(
            argv, cwd=tree, env=tree_env(tree) | env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def stop(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_line(log: Path, text: str, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while text not in log.read_text(errors="replace"):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            raise SystemExit(f"{log} never said {text!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- measurement


@dataclass
class Sample:
    request_id: str
    ttft_s: float
    sent_unix_s: float  # the wall clock, to place the service's spans
    opened_unix_s: float
    gaps_s: list[float] = field(default_factory=list)
    executor_ttft_s: float | None = None
    legs_s: dict[str, float] = field(default_factory=dict)  # where the added time went

    @property
    def added_s(self) -> float | None:
        return None if self.executor_ttft_s is None else self.ttft_s - self.executor_ttft_s


async def one_request(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> Sample:
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    sent_unix_s = time.time()
    began = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as response:
        opened = time.perf_counter()
        opened_unix_s = time.time()
        if response.status != 200:
            raise SystemExit(f"the gateway answered {response.status}: {await response.text()}")
        request_id = ""
        events: list[float] = []
        async for line in response.content:
            data = line.decode().strip().removeprefix("data: ")
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            request_id = request_id or str(chunk["id"]).removeprefix("cmpl-")
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text") and choices[0].get("finish_reason") is None:
                events.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(events)]
    return Sample(request_id, opened - began, sent_unix_s, opened_unix_s, gaps)


async def workload(url: str, requests: int, max_tokens: int) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.get(f"{url}/v1/models") as listed:
            model = str((await listed.json())["data"][0]["id"])  # as each tree names it
        for _ in range(3):  # warm-up: topics, the executor's first shapes, the reply cache
            await one_request(http, url, model, 4)
        return [await one_request(http, url, model, max_tokens) for _ in range(requests)]


@dataclass
class ExecutorTimes:
    """From the admission service's spans: per request id, the executor's seconds on the steps
    that prefilled it, when the service read it and when those steps went out and came back
    (wall clock); and every decode-only step's seconds."""

    prefill_s: dict[str, float]
    decode_steps_s: list[float]
    read_unix_s: dict[str, float] = field(default_factory=dict)
    first_step_unix_s: dict[str, float] = field(default_factory=dict)
    last_step_end_unix_s: dict[str, float] = field(default_factory=dict)
    round_trip_extra_s: dict[str, float] = field(default_factory=dict)


def executor_times(spans_file: Path) -> ExecutorTimes:
    times = ExecutorTimes({}, [])
    for line in spans_file.read_text().splitlines():
        span = json.loads(line)
        attributes = span["attributes"]
        start_s, end_s = span["start_unix_ns"] / 1e9, span["end_unix_ns"] / 1e9
        if span["kind"] == "CONSUMER" and "gen_ai.response.id" in attributes:
            times.read_unix_s[str(attributes["gen_ai.response.id"])] = start_s
        if span["name"] != "kvgate.step.round_trip":
            continue
        execute_s = attributes.get("kvgate.step.execute_s")
        if execute_s is None:
            continue
        prefilled = attributes.get("kvgate.step.prefill_ids") or []
        for rid in prefilled:
            times.prefill_s[rid] = times.prefill_s.get(rid, 0.0) + float(execute_s)
            times.first_step_unix_s.setdefault(rid, start_s)
            times.last_step_end_unix_s[rid] = end_s
            extra = end_s - start_s - float(execute_s)
            times.round_trip_extra_s[rid] = times.round_trip_extra_s.get(rid, 0.0) + extra
        if not prefilled and attributes.get("kvgate.step.decode_ids"):
            times.decode_steps_s.append(float(execute_s))
    return times


def joined(samples: list[Sample], times: ExecutorTimes) -> list[Sample]:
    """Each sample with its executor time and the legs of its added time: HTTP in to the
    service reading it, to its first step going out, the steps' time beyond the executor's
    compute (transport, planning), and its last prefill step's result to the stream opening."""
    for sample in samples:
        rid = sample.request_id
        sample.executor_ttft_s = times.prefill_s.get(rid)
        if rid in times.read_unix_s and rid in times.first_step_unix_s:
            sample.legs_s = {
                "to service": times.read_unix_s[rid] - sample.sent_unix_s,
                "to step": times.first_step_unix_s[rid] - times.read_unix_s[rid],
                "step transport": times.round_trip_extra_s[rid],
                "back": sample.opened_unix_s - times.last_step_end_unix_s[rid],
            }
    return samples


# ---------------------------------------------------------------------------------- brokers


@dataclass(frozen=True)
class Workload:
    model_dir: Path
    model: str
    requests: int
    max_tokens: int
    out: Path


def run_local(tree: Path, work: Workload, label: str) -> tuple[list[Sample], ExecutorTimes]:
    """``kvgate run`` from ``tree``: embedded broker, executor, service and gateway."""
    out = work.out / label
    out.mkdir(parents=True)
    port = free_port()
    log = out / "run.log"
    process = start(
        kvgate("run", "--model-dir", str(work.model_dir), "--threads", "1", "--gateway-port",
               str(port), "--out-dir", str(out)),
        tree, log,
    )  # fmt: skip
    try:
        wait_for_line(log, "kvgate is serving", [process])
        samples = asyncio.run(workload(f"http://127.0.0.1:{port}", work.requests, work.max_tokens))
    finally:
        stop(process)  # its tracer provider flushes the spans file on the way out
    times = executor_times(out / "spans.jsonl")
    return joined(samples, times), times


@contextlib.contextmanager
def real_kafka() -> Iterator[str]:
    """A single-node Kafka 4.4 container from the test harness; yields its bootstrap."""
    from tests.harness.docker_engine import docker_engine
    from tests.harness.kafka import ContainerKafka
    from tests.harness.kafka_image import ensure_kafka_image
    from tests.harness.system import cache_root

    def say(message: str) -> None:
        print(f"[harness] {message}", flush=True)

    with docker_engine(cache_root(), say) as engine:
        client = engine.client()
        try:
            image = ensure_kafka_image(client, cache_root(), say)
        finally:
            client.close()
        broker = ContainerKafka.start(engine.host, image)
        try:
            yield broker.bootstrap
        finally:
            broker.stop()


def run_real(
    tree: Path, work: Workload, label: str, bootstrap: str
) -> tuple[list[Sample], ExecutorTimes]:
    """Executor, admission service and gateway as processes from ``tree`` on real Kafka, on
    topics of their own; every setting but the addresses is the tree's default."""
    out = work.out / label
    out.mkdir(parents=True)
    base = f"bench-{uuid.uuid4().hex[:8]}"
    topic = {k: f"{base}.{k}" for k in ("requests", "results", "aborts", "dlq")}
    token = uuid.uuid4().hex
    executor_port, gateway_port = free_port(), free_port()
    config = out / "service.json"  # JSON is YAML
    config.write_text(
        json.dumps(
            {
                "kafka": {
                    "bootstrap_servers": bootstrap, "request_topic": topic["requests"],
                    "result_topic": topic["results"], "abort_topic": topic["aborts"],
                    "dlq_topic": topic["dlq"], "group_id": f"{base}-group", "partitions": 2,
                },
                "admin": {"host": "127.0.0.1", "port": 0, "token": token},
                "executors": {
                    "token": token,
                    "members": [{"name": "executor-0",
                                 "endpoint": f"ws://127.0.0.1:{executor_port}/v1/steps"}],
                },
                "limits": {"tokenizer_file": str(work.model_dir / "tokenizer.json")},
                "telemetry": {"spans_file": str(out / "spans.jsonl"), "model_name": work.model},
            }
        )
    )  # fmt: skip
    processes = [
        start(
            kvgate("executor", "--model", str(work.model_dir), "--host", "127.0.0.1", "--port",
                   str(executor_port), "--device", "cpu", "--num-blocks", "256",
                   "--executor-id", "executor-0", "--no-calibrate"),
            tree, out / "executor.log", KVGATE_EXECUTOR_TOKEN=token, OMP_NUM_THREADS="1",
            OTEL_SDK_DISABLED="true",
        ),
        start(kvgate("admission-service", "--config", str(config)), tree, out / "service.log"),
        start(
            kvgate("gateway", "--bootstrap", bootstrap, "--port", str(gateway_port),
                   "--replica-id", base, "--model", work.model, "--request-topic",
                   topic["requests"], "--result-topic", topic["results"], "--abort-topic",
                   topic["aborts"], "--tokenizer", str(work.model_dir / "tokenizer.json"),
                   "--allow-anonymous"),
            tree, out / "gateway.log", OTEL_SDK_DISABLED="true",
        ),
    ]  # fmt: skip
    try:
        wait_for_line(out / "gateway.log", "serving", processes)
        wait_for_line(out / "service.log", "assigned at offset", processes)
        samples = asyncio.run(
            workload(f"http://127.0.0.1:{gateway_port}", work.requests, work.max_tokens)
        )
    finally:
        for process in reversed(processes):
            stop(process)
    times = executor_times(out / "spans.jsonl")
    return joined(samples, times), times


# ---------------------------------------------------------------------------------- report


def quantile_ms(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return 1000 * values[0]
    return 1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(label: str, samples: list[Sample], times: ExecutorTimes) -> str:
    added = [s.added_s for s in samples if s.added_s is not None]
    ttft = [s.ttft_s for s in samples]
    executor = [s.executor_ttft_s for s in samples if s.executor_ttft_s is not None]
    gaps = [g for s in samples for g in s.gaps_s]
    bunched = sum(1 for g in gaps if g < BUNCHED_S) / len(gaps) if gaps else float("nan")
    decode = statistics.median(times.decode_steps_s) * 1000 if times.decode_steps_s else 0.0
    legs = " ".join(
        f"{name} {quantile_ms([s.legs_s[name] for s in samples if s.legs_s], 50):.1f}"
        for name in ("to service", "to step", "step transport", "back")
    )
    return (
        f"{label:24s} added TTFT p50 {quantile_ms(added, 50):6.1f} p90 "
        f"{quantile_ms(added, 90):6.1f} ms | TTFT p50 {quantile_ms(ttft, 50):6.1f} executor p50 "
        f"{quantile_ms(executor, 50):6.1f} ms | gaps p10 {quantile_ms(gaps, 10):5.1f} p50 "
        f"{quantile_ms(gaps, 50):5.1f} p90 {quantile_ms(gaps, 90):5.1f} p99 "
        f"{quantile_ms(gaps, 99):6.1f} ms, bunched {100 * bunched:4.1f} % (decode step p50 "
        f"{decode:.1f} ms) | {len(added)}/{len(samples)} matched\n"
        f"{'':24s} added TTFT's legs, p50 ms: {legs}"
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} on {os.cpu_count()} CPUs"


def model_dir(args: argparse.Namespace, out: Path) -> tuple[Path, str]:
    if args.model_dir is not None:
        return args.model_dir, args.model_dir.name
    if args.tiny:
        path = out / "tiny-model"
        subprocess.run(kvgate("make-tiny-model", str(path)), check=True, capture_output=True)
        return path, path.name
    if args.tiny_words:
        from tests.admission_service.word_tokenizers import word_tokenizer

        path = out / "tiny-words"
        subprocess.run(kvgate("make-tiny-model", str(path), "--no-tokenizer"), check=True,
                       capture_output=True)  # fmt: skip
        vocab_size = int(json.loads((path / "config.json").read_text())["vocab_size"])
        word_tokenizer(path, seed=0, words=vocab_size - 3)  # every id a word of its own
        return path, path.name
    from kvgate.executor.packaged import packaged_gguf

    gguf = packaged_gguf()
    if gguf is None:
        raise SystemExit("the packaged model is not installed: pass --tiny or --model-dir")
    converted = subprocess.run(
        kvgate("convert", str(gguf), "--cache"), check=True, capture_output=True, text=True
    )
    return Path(converted.stdout.strip().splitlines()[-1]), gguf.stem.split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default="HEAD", help="the revision measured (HEAD; '.': as is)")
    parser.add_argument("--baseline", help="a revision to compare against (e.g. HEAD~3)")
    parser.add_argument("--kafka", default="local,real", help="local, real or both (comma)")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--tiny", action="store_true")
    model.add_argument("--tiny-words", action="store_true", help="the tiny model, a word each")
    model.add_argument("--model-dir", type=Path)
    args = parser.parse_args()
    brokers = [b.strip() for b in args.kafka.split(",") if b.strip()]
    revisions = [args.tree] + ([args.baseline] if args.baseline else [])
    described = {
        rev: subprocess.run(
            ["git", "-C", str(REPO), "log", "-1", "--format=%h %s", "HEAD" if rev == "." else rev],
            check=True, capture_output=True, text=True,
        ).stdout.strip()[:72] + (" + uncommitted edits" if rev == "." else "")
        for rev in revisions
    }  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="kvgate-bench-interactive-"))
    path, name = model_dir(args, out)
    work = Workload(path, name, args.requests, args.max_tokens, out)
    print(f"model {name}; {args.requests} requests x {args.max_tokens} tokens; {load()}")
    for rev, text in described.items():
        print(f"  {rev}: {text}")
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        trees = {rev: stack.enter_context(worktree(rev)) for rev in revisions}
        bootstrap = stack.enter_context(real_kafka()) if "real" in brokers else None
        for round_ in range(args.rounds):
            order = revisions if round_ % 2 == 0 else list(reversed(revisions))
            for broker in brokers:
                for rev in order:
                    label = f"{broker} {rev} r{round_ + 1}"
                    tag = f"{broker}-{rev.replace('~', '_').replace('/', '_')}-{round_}"
                    if broker == "local":
                        samples, times = run_local(trees[rev], work, tag)
                    else:
                        assert bootstrap is not None
                        samples, times = run_real(trees[rev], work, tag, bootstrap)
                    line = report(label, samples, times)
                    lines.append(line)
                    print(line, f"({load()})", flush=True)
    print(f"\nlogs and spans in {out}")
    for written in ("tiny-model", "tiny-words"):
        shutil.rmtree(out / written, ignore_errors=True)


if __name__ == "__main__":
    main()
