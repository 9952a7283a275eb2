"""``kvgate run``: the demo's stack, serving until Ctrl-C.

By default it serves the packaged SmolLM2-135M-Instruct, and the OpenAI API on
``http://127.0.0.1:8000/v1`` (loopback, no key): ``--tiny`` / ``--model`` / ``--model-dir``
choose another model (``model_choice.py``), ``--no-gateway`` leaves the OpenAI door closed.
Requests can also be produced to ``kvgate.requests`` (``kvgate produce FILE.jsonl --bootstrap
...``); results go to ``kvgate.results`` (``kvgate results --bootstrap ...``).

It says it serves once, after every part answers (``readiness.py``), with the addresses to use.

``--smollm2`` and ``--gateway`` chose what is now the default; they are still accepted (so are
scripts written for them) and change nothing: ``--gateway`` is the positive half of
``--gateway/--no-gateway``, ``--smollm2`` a spelling of "no model flag" left out of ``--help``.

Tuning (``tuning.py``): the scheduler's limits as flags (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--prefill-chunk-size``, ``--policy``, ``--preemption``), each
above its ``KVGATE_SCHEDULER__*`` variable, which is above the defaults below; ``--threads``
above ``OMP_NUM_THREADS`` above the machine's rule. The banner says what is in effect.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from kvgate.admission_service.cli import configure_telemetry
from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import TelemetrySettings
from kvgate.gateway.server import Gateway
from kvgate.kafka_connection import SettingsError
from kvgate.local.model_choice import (
    ModelChoice,
    PackagedModelMissing,
    add_model_arguments,
    chosen_model,
)
from kvgate.local.readiness import stack_probes, wait_until_answering
from kvgate.local.stack import LocalStack, StackOptions, local_gateway_settings
from kvgate.local.tuning import (
    MAX_DEFAULT_THREADS,
    THREADS_ENV,
    SchedulerLimits,
    ThreadChoice,
    add_scheduler_arguments,
    executor_threads,
    refuse_owned_variables,
    scheduler_flags,
)
from kvgate.protocol import topics
from kvgate.telemetry.setup import TelemetryConfigError

# kvgate run's scheduler defaults (beneath KVGATE_SCHEDULER__* and the flags): up to 32
# sequences for a server's concurrent clients.
RUN_SCHEDULER = SchedulerLimits(max_num_seqs=32, max_num_batched_tokens=256, prefill_chunk_size=64)

# From the stack being up (broker answering, executor model loaded) to every part answering:
# the executor's session and the gateway's Kafka bridge take about a second each.
SERVING_TIMEOUT_S = 60.0


class GatewayPortBusy(RuntimeError):
    """The OpenAI API's port is taken; the message says what to pass instead."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=Path("kvgate-demo-out"))
    add_model_arguments(parser)
    # Outside the model flags' exclusive group: a hidden member would garble its usage line.
    parser.add_argument("--smollm2", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--threads", type=int,
        help=f"executor torch threads (default: {THREADS_ENV}, else 1 with --tiny, else the "
        f"physical cores this process may use, at most {MAX_DEFAULT_THREADS})",
    )  # fmt: skip
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the executor's batch-invariant mode: a request's tokens and logprobs do not "
        "depend on what it is batched with",
    )
    parser.add_argument("--port", type=int, help="Kafka port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--num-blocks", type=int, default=256, help="executor KV cache blocks")
    parser.add_argument("--token-topic", action="store_true", help="also stream tokens")
    parser.add_argument(
        "--gateway",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the OpenAI API on 127.0.0.1 without a key (default: on)",
    )
    parser.add_argument("--gateway-port", type=int, default=8000, help="its port (0: a free one)")
    add_scheduler_arguments(parser, {k: str(v) for k, v in RUN_SCHEDULER.settings().items()})


def run(args: argparse.Namespace) -> int:
    started_s = time.monotonic()
    if args.smollm2 and (args.tiny or args.model or args.model_dir):
        print("kvgate run: --smollm2 is the default model; drop it or the other", file=sys.stderr)
        return 2
    try:
        model = chosen_model(args)
        threads = executor_threads(args.threads, tiny=model.tiny)
        refuse_owned_variables()
    except (PackagedModelMissing, SettingsError) as exc:
        print(f"kvgate run: {exc}", file=sys.stderr)
        return 2
    if args.gateway and not _port_free(args.gateway_port):
        # Said now rather than after the model has loaded (the port could still be taken in
        # between: then _open says the same).
        print(f"kvgate run: {_port_taken(args.gateway_port)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        provider = configure_telemetry(
            TelemetrySettings(service_name="kvgate-run", spans_file=args.out_dir / "spans.jsonl")
        )
    except TelemetryConfigError as exc:
        print(f"kvgate run: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args, model, threads, started_s))
    except (RuntimeError, FileNotFoundError, SettingsError) as exc:
        print(f"kvgate run: {exc}", file=sys.stderr)
        return 2
    finally:
        if provider is not None:
            provider.shutdown()


async def _serve(
    args: argparse.Namespace, model: ModelChoice, threads: ThreadChoice, started_s: float
) -> int:
    options = StackOptions(
        out_dir=args.out_dir,
        model_dir=model.model_dir,
        model_gguf=model.gguf,
        gguf_weights=model.gguf_weights,
        activations=model.activations,
        executor_threads=threads.count,
        executor_batch_invariant=args.batch_invariant,
        family=args.family,
        num_blocks=args.num_blocks,
        broker_port=args.port,
        scheduler_defaults=RUN_SCHEDULER,
        scheduler=scheduler_flags(args),
    )
    overrides: dict[str, dict[str, object]] = {"telemetry": {"model_name": model.name}}
    if args.token_topic:
        overrides["kafka"] = {"token_topic": topics.TOKENS}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LocalStack(options, **overrides) as stack:
        service = stack.service
        assert service is not None
        gateway = None
        if args.gateway:
            settings = local_gateway_settings(
                service.settings, stack.bootstrap, args.gateway_port, args.out_dir / "batches"
            )
            gateway = Gateway(settings)
        try:
            if gateway is not None:
                await _open(gateway, args.gateway_port)
            admin_url = f"http://127.0.0.1:{service.admin_port}"
            openai_url = None if gateway is None else f"http://127.0.0.1:{gateway.port}"
            await wait_until_answering(
                stack_probes(admin_url, openai_url, model.name),
                timeout_s=SERVING_TIMEOUT_S,
                stopped=stack.stopped,
            )
            ready_s = time.monotonic() - started_s
            print(_banner(stack, service, model, openai_url, threads, ready_s), flush=True)
            stopping = asyncio.create_task(stop.wait())
            failing = asyncio.create_task(service.failed.wait())
            await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            failing.cancel()
        finally:
            if gateway is not None:
                await gateway.close()
        return 1 if service.failure is not None else 0


def _port_taken(port: int) -> str:
    return (
        f"the OpenAI API cannot listen on 127.0.0.1:{port} (in use): pass --gateway-port P "
        "(0: a free one), or --no-gateway"
    )


def _port_free(port: int) -> bool:
    if port == 0:
        return True
    with socket.socket() as sock:
        # As aiohttp binds: a port that only has connections in TIME_WAIT (a restart right
        # after Ctrl-C) is free for a listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _open(gateway: Gateway, port: int) -> None:
    try:
        await gateway.start()
    except OSError as exc:
        raise GatewayPortBusy(_port_taken(port)) from exc


def _banner(
    stack: LocalStack,
    service: AdmissionService,
    model: ModelChoice,
    openai_url: str | None,
    threads: ThreadChoice,
    ready_s: float,
) -> str:
    kafka, admin = service.settings.kafka, service.settings.admin
    limits = service.settings.scheduler
    door = "off (--no-gateway)" if openai_url is None else f"{openai_url}/v1 (no key)"
    where = f"token in {admin.token_file}" if admin.token_file else "no admin token"
    return (
        f"\nkvgate is serving (ready in {ready_s:.1f} s).\n"
        f"  model             {model.name}\n"
        f"  scheduler         {limits.max_num_seqs} sequences, {limits.max_num_batched_tokens}"
        f" tokens per step, prefill chunk {limits.prefill_chunk_size}, {limits.policy.value}"
        f" order, preemption {limits.preemption.value}\n"
        f"  executor threads  {threads.count} ({threads.source})\n"
        f"  OpenAI API        {door}\n"
        f"  Kafka bootstrap   {stack.bootstrap}\n"
        f"  requests topic    {kafka.request_topic}\n"
        f"  results topic     {kafka.result_topic}\n"
        f"  admin API         http://127.0.0.1:{service.admin_port} ({where})\n"
        f"  produce:  kvgate produce FILE.jsonl --bootstrap {stack.bootstrap}\n"
        f"  results:  kvgate results --bootstrap {stack.bootstrap} --from-beginning\n"
        f"Ctrl-C to stop.\n"
    )
