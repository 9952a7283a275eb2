"""``kvgate demo``: the whole system on this machine, a workload through it, a report.

Starts the embedded Kafka broker, one CPU executor and the admission service (``stack.py``);
produces a mixed-priority workload that puts the KV cache under pressure (plus one request too
large for the cache and one malformed record); follows ``kvgate.results`` with a progress bar;
prints a summary table and a few prompts with their completions; writes every span of the
admission service to ``<out>/spans.jsonl`` and a timeline plot to ``<out>/timeline.png``.

The model is the packaged SmolLM2-135M-Instruct (converted into the cache on first use) with
text and chat prompts; ``--tiny`` serves a small random model with token-id prompts instead
(fast, for tests); ``--model`` / ``--model-dir`` serve another GGUF file or model directory.

Exit status: 0 when every request with a readable id was answered, 1 when any was lost, 2 when
the stack could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvgate.admission_service.settings import ServiceSettings
from kvgate.gateway.server import Gateway
from kvgate.kafka_connection import SettingsError
from kvgate.local.demo_report import (
    DemoRequest,
    demo_text_workload,
    demo_workload,
    plot_timeline,
    summarize,
    summary_rows,
)
from kvgate.local.model_choice import (
    ModelChoice,
    PackagedModelMissing,
    add_model_arguments,
    chosen_model,
)
from kvgate.local.stack import LocalStack, StackOptions, local_gateway_settings
from kvgate.local.tuning import (
    MAX_DEFAULT_THREADS,
    THREADS_ENV,
    SchedulerLimits,
    add_scheduler_arguments,
    executor_threads,
    refuse_owned_variables,
    scheduler_flags,
)
from kvgate.protocol import topics
from kvgate.protocol.records import TRACEPARENT_HEADER, InferenceResult
from kvgate.telemetry.context import traceparent_of
from kvgate.telemetry.spans_file import JsonLinesSpanExporter

DEFAULT_OUT = Path("kvgate-demo-out")
GATEWAY_CHAT = "In one sentence, what does a queue do?"
log = logging.getLogger("kvgate.demo")


@dataclass(frozen=True)
class DemoLimits:
    """Workload size, the KV cache and the scheduler's defaults, per kind of model (flags beat
    ``KVGATE_SCHEDULER__*`` variables, which beat these: ``tuning.py``)."""

    requests: int
    num_blocks: int  # KV cache blocks of 16 tokens: small enough to force preemptions
    scheduler: SchedulerLimits


# The tiny model is all overhead: many requests. SmolLM2 (135 M parameters, 30 layers): a
# dozen requests, 14 blocks (224 tokens) for up to 6 sequences of ~30-70 tokens each, so the
# cache runs out and requests are preempted. Threads follow tuning.executor_threads.
TINY_LIMITS = DemoLimits(
    requests=32, num_blocks=48,
    scheduler=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=64),
)  # fmt: skip
REAL_LIMITS = DemoLimits(
    requests=12, num_blocks=14,
    scheduler=SchedulerLimits(max_num_seqs=6, max_num_batched_tokens=256, prefill_chunk_size=32),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, help="workload size (32 tiny, 12 real)")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (48 tiny, 14 real)")
    parser.add_argument(
        "--threads", type=int,
        help=f"executor torch threads (default: {THREADS_ENV}, else 1 with --tiny, else the "
        f"physical cores this process may use, at most {MAX_DEFAULT_THREADS})",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--no-bad-input", action="store_true", help="only valid requests")
    tiny, real = TINY_LIMITS.scheduler.settings(), REAL_LIMITS.scheduler.settings()
    defaults = {k: f"{tiny[k]} tiny, {real[k]} real" for k in tiny if k in real}
    add_scheduler_arguments(parser, defaults, aliases={"prefill_chunk_size": "--chunk-size"})


def demo_limits(args: argparse.Namespace) -> DemoLimits:
    base = TINY_LIMITS if args.tiny else REAL_LIMITS
    chosen = {"requests": args.requests, "num_blocks": args.num_blocks}
    return replace(base, **{k: v for k, v in chosen.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    limits = demo_limits(args)
    if min(limits.requests, limits.num_blocks) < 1:
        print("kvgate demo: sizes and counts must be at least 1", file=sys.stderr)
        return 2
    try:
        model = chosen_model(args)
        threads = executor_threads(args.threads, tiny=model.tiny)
        refuse_owned_variables()
    except (PackagedModelMissing, SettingsError) as exc:
        print(f"kvgate demo: {exc}", file=sys.stderr)
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
        return asyncio.run(_demo(args, limits, threads.count, model, console))
    finally:
        provider.shutdown()


async def _demo(
    args: argparse.Namespace, limits: DemoLimits, threads: int, model: ModelChoice,
    console: Console,
) -> int:  # fmt: skip
    options = StackOptions(
        out_dir=args.out_dir,
        model_dir=model.model_dir,
        model_gguf=model.gguf,
        gguf_weights=model.gguf_weights,
        activations=model.activations,
        family=args.family,
        num_blocks=limits.num_blocks,
        scheduler_defaults=limits.scheduler,
        scheduler=scheduler_flags(args),
        executor_threads=threads,
        timeline_steps=100_000,
    )
    make_workload = demo_workload if args.tiny else demo_text_workload
    workload = make_workload(limits.requests, with_bad_input=not args.no_bad_input)
    console.print(f"[bold]kvgate demo[/bold]: {len(workload)} records, output in {args.out_dir}/")
    started = time.monotonic()
    try:
        with console.status("starting the broker, the executor and the admission service"):
            stack = await LocalStack(
                options, executors={"reconnect_max_s": 0.5}, telemetry={"model_name": model.name}
            ).__aenter__()
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
        http: GatewayAnswer | str
        try:
            with console.status("one more request, through the OpenAI API"):
                http = await _through_the_gateway(service.settings, stack.bootstrap, args.tiny)
        except (OSError, RuntimeError, aiohttp.ClientError, ValueError) as exc:
            http = f"{type(exc).__name__}: {exc}"
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
    completions = _completions_table(workload, results)
    if completions is not None:
        console.print(completions)
    if isinstance(http, str):
        console.print(f"[red]the request through the OpenAI API failed:[/red] {http}")
    else:
        console.print(
            f"through the OpenAI API at {http.url} (streamed): {http.prompt!r} -> ",
            Text(repr(http.text.strip())), f" first token after {http.ttft_s * 1000:.0f} ms",
            sep="",
        )  # fmt: skip
    plot_path = args.out_dir / "timeline.png"
    if samples:
        plot_timeline(samples, kv_total, plot_path)
        console.print(f"timeline: {plot_path}   spans: {args.out_dir / 'spans.jsonl'}")
    if summary.lost:
        console.print(f"[red]{len(summary.lost)} requests were lost:[/red] {summary.lost}")
        return 1
    return 1 if isinstance(http, str) else 0


@dataclass(frozen=True)
class GatewayAnswer:
    url: str
    prompt: str
    text: str
    ttft_s: float


async def _through_the_gateway(
    service: ServiceSettings, bootstrap: str, tiny: bool
) -> GatewayAnswer:
    """The stack's OpenAI door (what ``kvgate run`` serves): one streamed, greedy request — a
    chat message on the real model, token ids on the tiny one (no chat template there)."""
    gateway = Gateway(local_gateway_settings(service, bootstrap, 0))
    await gateway.start()
    url = f"http://127.0.0.1:{gateway.port}/v1"
    model = service.telemetry.model_name
    if tiny:
        prompt, route = "[1, 2, 3, 4]", "/completions"
        body: dict[str, object] = {"prompt": [1, 2, 3, 4], "max_tokens": 8}
    else:
        prompt, route = GATEWAY_CHAT, "/chat/completions"
        body = {"messages": [{"role": "user", "content": GATEWAY_CHAT}], "max_tokens": 40}
    body |= {"model": model, "temperature": 0, "stream": True}
    began = time.monotonic()
    first: float | None = None
    pieces: list[str] = []
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + route, json=body) as response,
        ):
            if response.status != 200:
                answer = await response.text()
                raise RuntimeError(f"the gateway answered {response.status}: {answer}")
            async for line in response.content:
                data = line.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]" or not data.startswith("{"):
                    continue
                for choice in json.loads(data).get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece and first is None:
                        first = time.monotonic() - began
                    pieces.append(piece)
    finally:
        await gateway.close()
    return GatewayAnswer(url, prompt, "".join(pieces), first if first is not None else 0.0)


def _completions_table(
    workload: list[DemoRequest], results: dict[str, InferenceResult], count: int = 4
) -> Table | None:
    """A few completed prompts with their completions: half plain text, half chat."""
    done = [r for r in workload if r.shown is not None and results.get(r.request_id)]
    chats = [r for r in done if r.shown and r.shown.startswith("(chat)")]
    plain = [r for r in done if r not in chats]
    shown = plain[: count // 2] + chats[: count - count // 2]
    if not shown:
        return None
    table = Table(title="prompts and completions", show_lines=True)
    table.add_column("request")
    table.add_column("prompt", max_width=40)
    table.add_column("completion", max_width=60)
    for request in sorted(shown, key=lambda r: r.request_id):
        result = results[request.request_id]
        # Text objects: model output is not rich markup.
        table.add_row(
            request.request_id, Text(request.shown or ""), Text((result.text or "").strip())
        )
    return table


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
