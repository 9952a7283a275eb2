"""Drain with KV snapshot migration against recompute-only, in the same run.

Two step servers on localhost HTTP (the simulated executor, a tiny random checkpoint, or the
packaged SmolLM2-135M), the admission engine over its WebSocket connector. ``--requests``
requests of ``--prompt`` tokens start on executor ``a`` alone; once each has ``--decoded``
tokens out, ``b`` joins and ``a`` drains. Reported per mode:

- recomputed tokens: K/V positions rebuilt by prefill after the move (``recomputed_tokens`` of
  the results, summed);
- drain s: from the drain until ``a`` holds nothing (``DRAINED``);
- resume s: from the drain until every moved request has sampled its first token on ``b``
  (the slowest one);
- total s: from the first submit until every request is answered;
- migrations: ``kvgate_admission_migrations_total`` by outcome.

Outputs of the two modes are compared token for token (greedy).

    PYTHONPATH=. python benchmarks/bench_migration.py --model sim|tiny|smollm2 [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.admission_service.engine import Engine, EngineSettings
from kvgate.admission_service.executor_client import WebSocketConnector
from kvgate.admission_service.executor_handle import ExecutorHandle, SessionSettings
from kvgate.admission_service.metrics import ServiceMetrics
from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.tracing import ServiceTracer
from kvgate.admission_service.validation import Accepted, RawRecord, validate_request
from kvgate.protocol.admin import ExecutorSpec, ExecutorState
from kvgate.protocol.records import InferenceResult
from kvgate.scheduler.config import SchedulerConfig
from kvgate.scheduler.events import RequestEvent, TokenEvent
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.sim.server import sim_step_server
from kvgate.step_server.server import StepBackend, StepServer

TOKEN = "bench-migration"
BLOCK_SIZE = 16


@dataclass
class Sink:
    answers: dict[str, InferenceResult] = field(default_factory=dict)
    count: int = 0

    def answer(self, result: InferenceResult, traceparent: object, reply: object = None) -> None:
        self.answers[result.request_id] = result
        self.count += 1

    def reject(self, record: object, rejection: object, result: object) -> None:
        raise AssertionError(f"rejected: {rejection}")

    def lane(self, source: object, reply: object = None) -> None:
        return None  # nothing streamed


@dataclass
class Figures:
    recomputed: int
    drain_s: float
    resume_s: float
    total_s: float
    migrations: dict[str, int]
    outputs: dict[str, list[int]]


def _loader(model: str, device: str, model_dir: Path | None) -> Callable[[], StepBackend]:
    def load() -> StepBackend:
        from kvgate.executor.executor import Executor
        from kvgate.executor.loader import load_model

        assert model_dir is not None
        return Executor(
            load_model(model_dir, device=device),
            num_blocks=1024,
            block_size=BLOCK_SIZE,
            host_snapshot_blocks=4096,
            device=device,
        )

    return load


def _server(model: str, device: str, model_dir: Path | None) -> StepServer:
    if model == "sim":
        config = SimExecutorConfig(
            num_blocks=1024, block_size=BLOCK_SIZE, host_snapshot_blocks=4096, vocab_size=4096
        )
        # An emulated step time: the simulated model costs nothing, a prefill chunk does.
        return sim_step_server(SimBackend(config), TOKEN, step_time_s=0.002)
    return StepServer(_loader(model, device, model_dir), TOKEN)


async def _until(condition: Callable[[], bool], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark stalled")
        await asyncio.sleep(0.002)


async def run_mode(args: argparse.Namespace, model_dir: Path | None, migrate: bool) -> Figures:
    runners = []
    ports = []
    for _ in range(2):
        runner = web.AppRunner(_server(args.model, args.device, model_dir).app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    sink = Sink()
    async with aiohttp.ClientSession() as http:
        connector = WebSocketConnector(
            http, TOKEN, connect_timeout_s=10.0, heartbeat_s=10.0, step_timeout_s=120.0
        )
        settings = EngineSettings(
            scheduler=SchedulerConfig(
                max_num_seqs=max(8, args.requests),
                max_num_batched_tokens=4096,
                prefill_chunk_size=2048,
            ),
            session=SessionSettings(
                reconnect_initial_s=0.05,
                reconnect_max_s=0.5,
                enable_prefix_caching=False,
                migrate_on_drain=migrate,
            ),
        )
        metrics = ServiceMetrics()
        engine = Engine(
            settings, connector=connector, sink=sink, tracer=ServiceTracer(), metrics=metrics
        )
        # When each request first samples a token on b (the engine's own event feed).
        first_token_on_b: dict[str, float] = {}
        on_events = engine.on_events

        def record_events(handle: ExecutorHandle, events: list[RequestEvent]) -> None:
            if handle.name == "b":
                now = time.perf_counter()
                for event in events:
                    if isinstance(event, TokenEvent):
                        first_token_on_b.setdefault(event.request_id, now)
            on_events(handle, events)

        engine.on_events = record_events  # type: ignore[method-assign]
        specs = [
            ExecutorSpec(name=name, endpoint=f"ws://127.0.0.1:{port}/v1/steps")
            for name, port in zip("ab", ports, strict=True)
        ]
        try:
            await engine.set_members(specs[:1])
            await _until(lambda: engine.handles["a"].accepts_work)
            limits = LimitsSettings()
            began = time.perf_counter()
            for i in range(args.requests):
                prompt = [(31 * i + 7 * j) % 4000 + 1 for j in range(args.prompt)]
                body = {
                    "request_id": f"r{i}",
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "sampling": {"ignore_eos": True, "temperature": 0.0},
                }
                record = RawRecord("requests", 0, i, None, json.dumps(body).encode())
                verdict = validate_request(record, limits, None)
                assert isinstance(verdict, Accepted), verdict
                engine.submit(record, verdict)
            a = engine.handles["a"]

            def outputs_on_a() -> dict[str, int]:
                assert a.scheduler is not None
                return {
                    rid: len(r.output_token_ids) for rid, r in a.scheduler.state.requests.items()
                }

            await _until(
                lambda: (
                    len(outputs_on_a()) == args.requests
                    and min(outputs_on_a().values()) >= args.decoded
                )
            )
            await engine.set_members([specs[0].model_copy(update={"draining": True}), specs[1]])
            drained_at = time.perf_counter()
            at_drain = outputs_on_a()
            drain_s = resume_s = None
            while drain_s is None or resume_s is None:
                now = time.perf_counter() - drained_at
                if drain_s is None and a.state is ExecutorState.DRAINED:
                    drain_s = now
                if resume_s is None and set(at_drain) <= set(first_token_on_b) | set(sink.answers):
                    resume_s = max(first_token_on_b.values(), default=now) - drained_at
                await asyncio.sleep(0.001)
            await _until(lambda: sink.count >= args.requests)
            total_s = time.perf_counter() - began
        finally:
            await engine.close()
            for runner in runners:
                await runner.cleanup()
    migrations = {
        s.labels["outcome"]: int(s.value)
        for m in metrics.migrations.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert sink.count == args.requests, "every request answered once"
    return Figures(
        recomputed=sum(r.scheduling.recomputed_tokens for r in sink.answers.values()),
        drain_s=drain_s,
        resume_s=resume_s,
        total_s=total_s,
        migrations=migrations,
        outputs={rid: r.output_token_ids for rid, r in sink.answers.items()},
    )


def _model_dir(model: str, scratch: Path) -> Path | None:
    if model == "sim":
        return None
    if model == "tiny":
        from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
        from kvgate.protocol.enums import ModelFamily

        spec = TinyModelSpec(
            family=ModelFamily.LLAMA, vocab_size=4096, hidden_size=256, intermediate_size=704,
            num_layers=4, num_heads=4, num_kv_heads=4, tokenizer=False,
            max_position_embeddings=8192,
        )  # fmt: skip
        return Path(make_tiny_model(scratch, spec))
    from kvgate.executor.gguf_checkpoint import cached_conversion
    from kvgate.executor.packaged import INSTALL_HINT, packaged_gguf

    gguf = packaged_gguf()
    if gguf is None:
        raise SystemExit(f"the packaged SmolLM2 model is not installed: {INSTALL_HINT}")
    return cached_conversion(gguf)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_dir(args.model, Path(scratch))
        rows: dict[str, list[Figures]] = {"recompute": [], "migrate": []}
        for _ in range(args.trials):
            for mode in ("recompute", "migrate"):  # alternate: same machine state for both
                rows[mode].append(await run_mode(args, model_dir, migrate=mode == "migrate"))
    reference = rows["recompute"][0].outputs
    equal = all(f.outputs == reference for fs in rows.values() for f in fs)
    print(
        f"model={args.model} device={args.device} requests={args.requests} prompt={args.prompt} "
        f"decoded_before_drain>={args.decoded} max_tokens={args.max_tokens} "
        f"trials={args.trials}"
    )
    print(f"{'mode':10} {'recomputed':>10} {'drain s':>9} {'resume s':>9} {'total s':>9}  "
          "migrations")  # fmt: skip
    for mode, figures in rows.items():
        med = statistics.median
        print(
            f"{mode:10} {med(f.recomputed for f in figures):>10.0f} "
            f"{med(f.drain_s for f in figures):>9.3f} {med(f.resume_s for f in figures):>9.3f} "
            f"{med(f.total_s for f in figures):>9.3f}  {figures[-1].migrations}"
        )
    print(f"outputs equal across modes and trials: {'yes' if equal else 'NO'}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["sim", "tiny", "smollm2"], default="sim")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decoded", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--trials", type=int, default=3)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parse()))
