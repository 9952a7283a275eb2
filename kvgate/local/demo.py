"""``kvgate demo``: the whole system on this machine, a workload through it, a report.

Starts the embedded Kafka broker, one CPU executor with a tiny model and the admission service
(``stack.py``); produces a mixed-priority workload that puts the KV cache under pressure (plus
one request too large for the cache and one malformed record); follows ``kvgate.results`` with
a progress bar; prints a summary table; writes every span of the admission service to
``<out>/spans.jsonl`` and a timeline plot to ``<out>/timeline.png``.

Exit status: 0 when every request with a readable id was answered, 1 when any was lost, 2 when
the stack could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvgate.local.demo_report import (
    DemoRequest,
    demo_workload,
    plot_timeline,
    summarize,
    summary_rows,
)
from kvgate.local.stack import LocalStack, StackOptions
from kvgate.protocol import topics
from kvgate.protocol.records import TRACEPARENT_HEADER, InferenceResult
from kvgate.telemetry.context import traceparent_of
from kvgate.telemetry.spans_file import JsonLinesSpanExporter

DEFAULT_OUT = Path("kvgate-demo-out")
log = logging.getLogger("kvgate.demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=32, help="workload size (default 32)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model-dir", type=Path, help="an existing model (default: a tiny one)")
    parser.add_argument("--family", choices=["llama", "looped"], default="llama")
    parser.add_argument("--num-blocks", type=int, default=48, help="executor KV cache blocks")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--no-bad-input", action="store_true", help="only valid requests")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    if args.requests < 1:
        print("kvgate demo: --requests must be at least 1", file=sys.stderr)
        return 2
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    spans_path = out_dir / "spans.jsonl"
    spans_path.unlink(missing_ok=True)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "kvgate-demo"}))
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(spans_path)))
    trace.set_tracer_provider(provider)
    console = Console()
    try:
        return asyncio.run(_demo(args, console))
    finally:
        provider.shutdown()


async def _demo(args: argparse.Namespace, console: Console) -> int:
    options = StackOptions(
        out_dir=args.out_dir,
        model_dir=args.model_dir,
        family=args.family,
        num_blocks=args.num_blocks,
        timeline_steps=100_000,
    )
    workload = demo_workload(args.requests, with_bad_input=not args.no_bad_input)
    console.print(f"[bold]kvgate demo[/bold]: {len(workload)} records, output in {args.out_dir}/")
    started = time.monotonic()
    try:
        with console.status("starting the broker, the executor and the admission service"):
            stack = await LocalStack(options, executors={"reconnect_max_s": 0.5}).__aenter__()
    except Exception as exc:  # the stack's error names the log to read
        console.print(f"[red]could not start the stack:[/red] {exc}")
        return 2
    try:
        console.print(
            f"stack up in {time.monotonic() - started:.1f} s (Kafka at {stack.bootstrap})"
        )
        results, wall_s = await _run_workload(stack.bootstrap, workload, args.timeout_s, console)
        service = stack.service
        assert service is not None and service.engine is not None
        samples = list(service.engine.timeline)
        kv_total = sum(g.kv_blocks_total for g in service.engine.executor_gauges())
    finally:
        await stack.close()
    expected = {r.request_id for r in workload if r.expects_result}
    summary = summarize(expected, results, wall_s)
    table = Table(title="kvgate demo summary", show_header=False)
    for name, value in summary_rows(summary):
        table.add_row(name, value)
    console.print(table)
    plot_path = args.out_dir / "timeline.png"
    if samples:
        plot_timeline(samples, kv_total, plot_path)
        console.print(f"timeline: {plot_path}   spans: {args.out_dir / 'spans.jsonl'}")
    if summary.lost:
        console.print(f"[red]{len(summary.lost)} requests were lost:[/red] {summary.lost}")
        return 1
    return 0


async def _run_workload(
    bootstrap: str, workload: list[DemoRequest], timeout_s: float, console: Console
) -> tuple[dict[str, InferenceResult], float]:
    expected = {r.request_id for r in workload if r.expects_result}
    consumer = AIOKafkaConsumer(
        topics.RESULTS, bootstrap_servers=bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    tracer = trace.get_tracer("kvgate.demo")
    results: dict[str, InferenceResult] = {}
    began = time.monotonic()
    try:
        for request in workload:
            with tracer.start_as_current_span(
                "send kvgate.requests", kind=SpanKind.PRODUCER
            ) as span:
                headers = [(TRACEPARENT_HEADER, traceparent_of(span.get_span_context()).encode())]
                await producer.send_and_wait(
                    topics.REQUESTS,
                    request.value,
                    key=request.request_id.encode(),
                    headers=headers,
                )
        columns = (
            TextColumn("requests answered"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("answered", total=len(expected))
            deadline = began + timeout_s
            while len(results.keys() & expected) < len(expected) and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=200)
                for messages in batch.values():
                    for message in messages:
                        result = InferenceResult.model_validate_json(message.value)
                        results.setdefault(result.request_id, result)
                progress.update(task, completed=len(results.keys() & expected))
    finally:
        await producer.stop()
        await consumer.stop()
    return results, time.monotonic() - began
