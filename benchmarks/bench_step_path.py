"""The admission service's CPU per step against lean executors over the real step protocol.

    python benchmarks/bench_step_path.py [--executors N] [--requests N] [--prompt N]
        [--max-tokens N] [--rows N] [--step-ms T] [--stream] [--traced] [--profile FILE]
        [--kafka [--token-records per_step|per_token|both] [--rounds N]]

The service's engine (placement, one scheduler and step loop per executor, answers, step spans)
runs in this process with the real WebSocket client; each executor is a lean stand-in in a
child process of its own that speaks the step protocol with plain ``json`` (it follows the
plans' registrations, frees, fills and decode rows and samples a hash, as
``kvgate.sim.counting_executor`` does) and pads each step to ``--step-ms`` (0: answer at once,
so the service is the bottleneck). Each executor gets ``--requests`` requests of ``--prompt`` +
``--max-tokens`` tokens at once, submitted as validated records, as Kafka would deliver them;
answers and token chunks are encoded as the outbox would encode them and then dropped, so no
broker runs (the Kafka side of the step path is measured in docs/reliability.md and
bench_ingest.py). With ``--kafka`` they go through the service's own ``Outbox`` and token
stream instead (one plain producer, as without transactions) to an embedded broker in a child
process (not counted), the token stream to a token topic; ``--token-records both`` alternates
a record per step and topic partition with a record per token, ``--rounds`` times, and prints
the medians and their ratio.

Printed: steps, rows per step, output tokens per second, and the CPU time of this process
(the service) per step and per output token, from the first request submitted to the last
answer. Executors' CPU is not counted. ``--profile FILE`` writes a cProfile of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from aiohttp import web

TOKEN = "bench-step-path-token"
_VOCAB = 32_000


# ----------------------------------------------------------------- the lean executor
@dataclass(slots=True)
class _Lean:
    seed: int
    max_tokens: int
    fill_length: int
    outputs: int
    cursor: int = 0


def _lean_info(name: str, num_blocks: int, block_size: int) -> dict[str, Any]:
    return {
        "executor_id": name,
        "model_family": "lean",
        "num_loops": 1,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "host_snapshot_blocks": 0,
        "vocab_size": _VOCAB,
        "eos_token_id": None,
        "max_model_len": 1 << 20,
        "kv_bytes_per_block": 0,
    }


def _lean_step(requests: dict[str, _Lean], plan: dict[str, Any], version: int) -> dict[str, Any]:
    for rid in plan.get("free", ()):
        requests.pop(rid, None)
    for new in plan.get("new_requests", ()):
        outputs = len(new.get("output_token_ids", ()))
        prompt = len(new["prompt_token_ids"])
        sampling = new.get("sampling", {})
        requests[new["request_id"]] = _Lean(
            seed=sampling.get("seed") or 0,
            max_tokens=sampling.get("max_tokens", 16),
            fill_length=prompt + outputs - 1 if outputs else prompt,
            outputs=outputs,
        )
    tokens: list[dict[str, Any]] = []

    def sample(rid: str, request: _Lean, position: int) -> None:
        token = (request.seed * 1_000_003 + position * 7919 + len(rid)) % _VOCAB
        request.outputs += 1
        tokens.append({"request_id": rid, "position": position, "token_id": token, "exit_depth": 1})

    for row in plan.get("prefill_rows", ()):
        if row.get("completes_fill"):
            request = requests[row["request_id"]]
            request.cursor = request.fill_length
            if request.outputs == 0:
                sample(row["request_id"], request, row["token_end"])
    ids: list[str] = []
    positions: list[int] = []
    skipped: list[str] = []
    for rid in plan.get("decode", {}).get("request_ids", ()):
        request = requests[rid]
        if request.outputs >= request.max_tokens:
            skipped.append(rid)
            continue
        ids.append(rid)
        positions.append(request.cursor)
        sample(rid, request, request.cursor + 1)
        request.cursor += 1
    sampled: dict[str, Any] = {}
    if version >= 2:  # the tokens as columns
        sampled = {"sampled": {
            "request_ids": [t["request_id"] for t in tokens],
            "positions": [t["position"] for t in tokens],
            "token_ids": [t["token_id"] for t in tokens],
            "exit_depths": [t["exit_depth"] for t in tokens],
        }}  # fmt: skip
        tokens = []
    return {
        "type": "result",
        "step_id": plan["step_id"],
        "tokens": tokens,
        **sampled,
        "decode": {
            "request_ids": ids,
            "positions": positions,
            "depths": [1] * len(ids),
            "exited": [True] * len(ids),
        },
        "skipped_request_ids": skipped,
        "counters": {"num_requests": len(requests)},
    }


def serve_lean(
    port: int, name: str, step_ms: float, num_blocks: int, block_size: int, protocol: int = 0
) -> None:
    """``protocol``: write results in this version whatever the opener speaks (0: the
    opener's)."""

    # (began, ended) of every step, on the machine's monotonic clock (time.monotonic in any
    # process), for ``busy_share``.
    log: list[tuple[float, float]] = []

    async def steps_since(http: web.Request) -> web.Response:
        since = float(http.query["since"])
        return web.json_response([entry for entry in log if entry[0] >= since])

    async def steps(http: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=64 * 2**20)
        if http.headers.get("Authorization") != f"Bearer {TOKEN}":
            raise web.HTTPUnauthorized()
        await ws.prepare(http)
        requests: dict[str, _Lean] = {}
        version = 1
        async for msg in ws:
            began = time.perf_counter()
            began_at = time.monotonic()
            message = json.loads(msg.data)
            if message["type"] == "open":
                requests.clear()
                version = message.get("protocol_version", 1) if protocol == 0 else protocol
                info = _lean_info(name, num_blocks, block_size)
                answer = {"type": "accepted", "epoch": message["epoch"], "info": info}
                await ws.send_str(json.dumps(answer))
                continue
            answer = json.dumps(_lean_step(requests, message, version))
            left_s = step_ms / 1000 - (time.perf_counter() - began)
            if left_s > 0:
                await asyncio.sleep(left_s)  # stands in for the GPU's step
            await ws.send_str(answer)
            log.append((began_at, time.monotonic()))
        return ws

    app = web.Application()
    app.router.add_get("/v1/steps", steps)
    app.router.add_get("/bench/steps", steps_since)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


async def busy_share(http: aiohttp.ClientSession, ports: list[int], since: float) -> float:
    """The share of their run the lean executors on ``ports`` spent in steps since ``since``
    (``time.monotonic``): each one's from its first step's start to its last step's end, the
    rest waiting for a plan (a GPU waiting for the control plane). 1.0: never waited."""
    busy = span = 0.0
    for port in ports:
        async with http.get(f"http://127.0.0.1:{port}/bench/steps?since={since}") as answer:
            log = await answer.json()
        if log:
            busy += sum(ended - began for began, ended in log)
            span += log[-1][1] - log[0][0]
    return busy / span if span else 0.0


# ----------------------------------------------------------------- the service side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _EncodingSink:
    """Encodes what the outbox would send, counts it, and drops it."""

    answers: int = 0
    chunks: int = 0
    output_tokens: int = 0

    def answer(self, result: Any, traceparent: object, reply: object = None) -> None:
        result.model_dump_json()
        self.answers += 1
        self.output_tokens += len(result.output_token_ids)

    def reject(self, record: object, rejection: object, result: object) -> None:
        raise AssertionError(f"rejected: {rejection}")

    def lane(self, source: Any, reply: object = None) -> Any:
        from kvgate.admission_service.token_stream import StreamLane, StreamTarget

        return StreamLane(source.partition, (StreamTarget("tokens", source.partition),))

    def put(self, lane: object, chunk: str) -> None:
        chunk.encode()
        self.chunks += 1


class _CountingSink:
    """The service's outbox, counting what passes through it."""

    def __init__(self, outbox: Any) -> None:
        self.outbox = outbox
        self.answers = self.output_tokens = 0
        self.lane, self.put = outbox.lane, outbox.put  # as the engine calls them (no layer)

    @property
    def chunks(self) -> int:
        return int(self.outbox.stream.chunks)

    def answer(self, result: Any, traceparent: str | None, reply: Any = None) -> None:
        self.answers += 1
        self.output_tokens += len(result.output_token_ids)
        self.outbox.answer(result, traceparent, reply)

    def reject(self, record: object, rejection: object, result: object) -> None:
        raise AssertionError(f"rejected: {rejection}")


async def _kafka_sink(
    bootstrap: str, token_records: str, num_records: int
) -> tuple[_CountingSink, Any, asyncio.Task[None]]:
    """The service's outbox on a fresh set of topics of one partition, every offset of
    ``num_records`` read, its commit cycles running."""
    from aiokafka import AIOKafkaProducer

    from kvgate.admission_service.kafka_io import ensure_topics
    from kvgate.admission_service.metrics import ServiceMetrics
    from kvgate.admission_service.offsets import PartitionLedger
    from kvgate.admission_service.outbox import Outbox
    from kvgate.admission_service.settings import KafkaSettings

    prefix = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    kafka = KafkaSettings(
        bootstrap_servers=bootstrap, request_topic=f"{prefix}.requests",
        result_topic=f"{prefix}.results", token_topic=f"{prefix}.tokens",
        abort_topic=f"{prefix}.aborts", dlq_topic=f"{prefix}.dlq", partitions=1,
        exactly_once="off", token_records=token_records,
    )  # fmt: skip
    await ensure_topics(kafka)

    async def commit_offsets(offsets: Any) -> None:
        pass  # no consumer group here: the cycles' sends are what is measured

    outbox = Outbox(
        kafka, transactional=False,
        producer_factory=lambda _id: AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", enable_idempotence=False
        ),
        commit_offsets=commit_offsets, metrics=ServiceMetrics(),
    )  # fmt: skip
    await outbox.start()
    await outbox.open_partition(0)
    outbox.track(0, PartitionLedger(committed=0))
    for offset in range(num_records):
        outbox.read(0, offset)
    return _CountingSink(outbox), outbox, asyncio.create_task(outbox.run())


async def _until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def run(
    args: argparse.Namespace,
    ports: list[int],
    bootstrap: str | None = None,
    token_records: str = "per_step",
    pids: list[int] | None = None,
) -> dict[str, float]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from kvgate.admission_service.engine import Engine, EngineSettings
    from kvgate.admission_service.executor_client import WebSocketConnector
    from kvgate.admission_service.executor_handle import SessionSettings
    from kvgate.admission_service.metrics import ServiceMetrics
    from kvgate.admission_service.settings import LimitsSettings
    from kvgate.admission_service.tracing import ServiceTracer
    from kvgate.admission_service.validation import Accepted, RawRecord, validate_request
    from kvgate.protocol.admin import ExecutorSpec
    from kvgate.scheduler.config import SchedulerConfig

    class _Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracer = ServiceTracer()
    if args.traced:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(_Drop()))
        tracer = ServiceTracer(provider.get_tracer("bench"))
    total = args.requests * len(ports)
    sink: _EncodingSink | _CountingSink = _EncodingSink()
    outbox = outbox_running = None
    if bootstrap is not None:
        sink, outbox, outbox_running = await _kafka_sink(bootstrap, token_records, total)
    steps = rows = 0
    async with aiohttp.ClientSession() as http:
        connector = WebSocketConnector(
            http, TOKEN, connect_timeout_s=10.0, heartbeat_s=30.0, step_timeout_s=120.0
        )
        settings = EngineSettings(
            scheduler=SchedulerConfig(
                max_num_seqs=args.rows,
                max_num_batched_tokens=args.rows + 2048,
                prefill_chunk_size=2048,
                async_scheduling=True,
            ),
            session=SessionSettings(
                reconnect_initial_s=0.05, reconnect_max_s=0.5, enable_prefix_caching=False
            ),
            token_stream=args.stream,
        )
        engine = Engine(
            settings, connector=connector, sink=sink, tracer=tracer, metrics=ServiceMetrics()
        )
        after_apply = engine.after_apply

        def count_step(handle: Any, plan: Any, result: Any, round_trip_s: float) -> None:
            nonlocal steps, rows
            steps += 1
            rows += plan.num_rows
            after_apply(handle, plan, result, round_trip_s)

        engine.after_apply = count_step  # type: ignore[method-assign]
        specs = [
            ExecutorSpec(name=f"e{i}", endpoint=f"ws://127.0.0.1:{port}/v1/steps")
            for i, port in enumerate(ports)
        ]
        await engine.set_members(specs)
        await _until(
            lambda: all(h.accepts_work for h in engine.handles.values()), 30.0, "executors"
        )
        limits = LimitsSettings(max_waiting_requests=10**7)
        records = []
        for i in range(total):
            body = {
                "request_id": f"r{i}",
                "prompt": [(31 * i + 7 * j) % 4000 + 1 for j in range(args.prompt)],
                "max_tokens": args.max_tokens,
                "sampling": {"ignore_eos": True, "seed": i},
            }
            records.append(RawRecord("requests", 0, i, None, json.dumps(body).encode()))
        profiler = cProfile.Profile() if args.profile else None
        executors_cpu0 = cpu_seconds(pids or [])
        started_at = time.monotonic()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for record in records:
            verdict = validate_request(record, limits, None)
            assert isinstance(verdict, Accepted), verdict
            engine.submit(record, verdict)
        await _until(lambda: sink.answers >= total, 600.0, "answers")
        if outbox is not None:  # until Kafka has every answer (the chunks were sent before)
            await _until(lambda: outbox.ledgers[0].committed >= total, 600.0, "commits")
        if profiler is not None:
            profiler.disable()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        executors_cpu_s = cpu_seconds(pids or []) - executors_cpu0
        lean = args.executor == "lean"  # (a sim executor logs no steps: not measured)
        busy = await busy_share(http, ports, started_at) if lean else math.nan
        await engine.close()
        if outbox is not None and outbox_running is not None:
            outbox.stop_soon()
            await outbox_running
            await outbox.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    assert sink.output_tokens == total * args.max_tokens, sink.output_tokens
    return {
        "steps": steps,
        "rows_per_step": rows / steps,
        "tokens_per_s": sink.output_tokens / wall_s,
        "cpu_ms_per_step": 1000 * cpu_s / steps,
        "executor_cpu_ms_per_step": 1000 * executors_cpu_s / steps,
        "cpu_us_per_token": 1e6 * cpu_s / sink.output_tokens,
        "steps_per_s_per_executor": steps / wall_s / len(ports),
        "chunks": sink.chunks,
        "records": outbox.stream.sent if outbox is not None else sink.chunks,
        "wall_s": wall_s,
        "busy_share": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executors", type=int, default=1)
    parser.add_argument("--requests", type=int, default=512, help="per executor")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--stream", action="store_true", help="stream tokens (token chunks)")
    parser.add_argument("--traced", action="store_true", help="record spans (dropped)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the run here")
    parser.add_argument(
        "--kafka", action="store_true",
        help="answers and chunks through the service's outbox to an embedded broker",
    )  # fmt: skip
    parser.add_argument(
        "--token-records", choices=["per_step", "per_token", "both"], default="per_step",
        help="with --kafka: the token stream's records (both: alternate them)",
    )  # fmt: skip
    parser.add_argument(
        "--protocol", choices=["1", "2", "both"], default="2",
        help="the executors' results: 1 tokens as objects, 2 as columns (both: alternate)",
    )  # fmt: skip
    parser.add_argument(
        "--executor", choices=["lean", "sim"], default="lean",
        help="lean: this script's stand-in; sim: kvgate sim-executor processes",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # child: NAME:PORT:V
    args = parser.parse_args()
    if args.serve is not None:
        name, port, version = args.serve.split(":")
        serve_lean(
            int(port), name, args.step_ms, num_blocks=65_536, block_size=16, protocol=int(version)
        )
        return
    if args.token_records == "both" and args.protocol == "both":
        parser.error("alternate one of --token-records and --protocol, not both")
    # A mode: (token records, protocol version), each with executors of its own.
    records_modes = (
        ["per_token", "per_step"] if args.token_records == "both" else [args.token_records]
    )
    versions = [1, 2] if args.protocol == "both" else [int(args.protocol)]
    modes = [(r, v) for r in records_modes for v in versions]
    ports = {mode: [free_port() for _ in range(args.executors)] for mode in modes}
    children = [
        subprocess.Popen(
            _executor_argv(args, i, port, mode[1]),
            env=os.environ | {"KVGATE_EXECUTOR_TOKEN": TOKEN},
        )
        for mode in modes
        for i, port in enumerate(ports[mode])
    ]
    owners = [mode for mode in modes for _ in ports[mode]]  # the mode of each child
    pids = {mode: [c.pid for c, m in zip(children, owners, strict=True) if m == mode]
            for mode in modes}  # fmt: skip
    runs: dict[tuple[str, int], list[dict[str, float]]] = {mode: [] for mode in modes}
    try:
        with contextlib.ExitStack() as stack:
            bootstrap = None
            if args.kafka:
                from kvgate.local.embedded_broker import EmbeddedBroker

                bootstrap = stack.enter_context(EmbeddedBroker()).bootstrap
            for _ in range(args.rounds):
                for mode in modes:
                    figures = asyncio.run(
                        run(args, ports[mode], bootstrap, mode[0], pids=pids[mode])
                    )
                    runs[mode].append(figures)
                    _print(args, figures, mode)
    finally:
        for child in children:
            child.terminate()
            child.wait(timeout=10)
    if len(modes) == 2:
        (base, new) = modes
        median = {m: statistics.median(f["cpu_ms_per_step"] for f in runs[m]) for m in modes}
        print(
            f"median service CPU per step: {_name(base)} {median[base]:.2f} ms, "
            f"{_name(new)} {median[new]:.2f} ms, ratio {median[new] / median[base]:.2f}"
        )


def _executor_argv(args: argparse.Namespace, index: int, port: int, version: int) -> list[str]:
    if args.executor == "lean":
        return [sys.executable, __file__, "--serve", f"e{index}:{port}:{version}",
                "--step-ms", str(args.step_ms)]  # fmt: skip
    return [
        sys.executable, "-m", "kvgate", "sim-executor", "--host", "127.0.0.1", "--port",
        str(port), "--executor-id", f"e{index}", "--num-blocks", "65536", "--block-size", "16",
        "--vocab-size", str(_VOCAB), "--step-time-ms", str(args.step_ms),
    ]  # fmt: skip


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` so far (Linux: /proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _name(mode: tuple[str, int]) -> str:
    return f"{mode[0]} records, protocol {mode[1]}"


def _print(args: argparse.Namespace, figures: dict[str, float], mode: tuple[str, int]) -> None:
    what = ("streamed" if args.stream else "not streamed") + (", traced" if args.traced else "")
    if args.kafka:
        what += ", through Kafka" + (f" ({mode[0]} records)" if args.stream else "")
    what += f", protocol {mode[1]}"
    print(
        f"{args.executors} executor(s), step {args.step_ms:g} ms, {what}: "
        f"{figures['steps']} steps of {figures['rows_per_step']:.0f} rows, "
        f"{figures['tokens_per_s']:,.0f} output tokens/s, "
        f"{figures['steps_per_s_per_executor']:.0f} steps/s per executor"
        + ("" if math.isnan(figures["busy_share"]) else f" (busy {figures['busy_share']:.1%})")
        + ", "
        f"service CPU {figures['cpu_ms_per_step']:.2f} ms per step "
        f"({figures['cpu_us_per_token']:.1f} µs per output token), "
        f"{figures['chunks']} token chunks in {figures['records']} records, "
        f"executor CPU {figures['executor_cpu_ms_per_step']:.2f} ms per step, "
        f"{figures['wall_s']:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
