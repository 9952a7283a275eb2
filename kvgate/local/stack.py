"""The whole system on one machine, for ``kvgate demo`` and ``kvgate run``.

```
EmbeddedBroker (Tansu, 127.0.0.1)  ◀──▶  AdmissionService (this process)  ──ws──▶  kvgate executor
                                                                                  (child process,
                                                                                   CPU)
```

The model is a GGUF file converted once into the cache (``kvgate convert --cache``), or a tiny
random one written once by ``kvgate make-tiny-model`` into the output directory; later runs
reuse either. The executor runs as a child process (it imports torch; this process
never does). Tansu has no transactions, so the service runs at-least-once here
(``exactly_once: off``) with the group timings Tansu needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.admission_service.service import AdmissionService, tune_garbage_collector
from kvgate.admission_service.settings import ServiceSettings, load_settings
from kvgate.batch.settings import BatchSettings, StoreKind, StoreSettings
from kvgate.gateway.settings import GatewaySettings, ModelRoute
from kvgate.kafka_connection import KafkaConnection
from kvgate.local.embedded_broker import EmbeddedBroker, EmbeddedBrokerSettings
from kvgate.local.model_choice import GgufWeights
from kvgate.local.tuning import (
    SchedulerLimits,
    overridden,
    refuse_owned_variables,
    scheduler_defaults,
)
from kvgate.protocol.enums import QuantActivations

log = logging.getLogger(__name__)

MODEL_MARKER = "config.json"
# Tansu holds a fetch that finds nothing for about its whole wait, even when a record arrives
# meanwhile, so every consumer hop on the interactive path (requests into the service, replies
# into the gateway) costs up to this long; Kafka answers at once and needs no such setting.
# Measured: a record's latency through one consumer, p50/p90, 185/227 ms at aiokafka's default
# 500, 4.6/11.8 ms at 20, 3.0/8.9 ms at 5; three idle consumers at 5 ms cost about 9 % of a
# core in Python and as much in Tansu.
TANSU_FETCH_MAX_WAIT_MS = 5
NO_FLAGS = SchedulerLimits()
STACK_SCHEDULER = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=64)


@dataclass(frozen=True)
class StackOptions:
    out_dir: Path
    model_dir: Path | None = None  # None: <out_dir>/model, written on first use
    model_gguf: Path | None = None  # served converted from the cache (kvgate convert --cache)
    gguf_weights: GgufWeights = GgufWeights.QUANTIZED  # model_gguf's: as stored, or dequantized
    activations: QuantActivations = QuantActivations.FLOAT32  # kvgate executor --activations
    family: str = "llama"
    num_blocks: int = 48
    block_size: int = 16
    host_snapshot_blocks: int = 32
    # The scheduler's limits: the stack's defaults (beneath KVGATE_SCHEDULER__* variables) and
    # the flags given (above them); see tuning.py.
    scheduler_defaults: SchedulerLimits = STACK_SCHEDULER
    scheduler: SchedulerLimits = NO_FLAGS
    executor_threads: int = 1
    executor_batch_invariant: bool = False  # kvgate executor --batch-invariant
    broker_port: int | None = None
    executor_ready_timeout_s: float = 240.0
    timeline_steps: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kvgate(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvgate", *argv]


async def ensure_tiny_model(options: StackOptions) -> Path:
    """The model directory, writing a tiny checkpoint there on first use."""
    model_dir = options.model_dir or options.out_dir / "model"
    if (model_dir / MODEL_MARKER).is_file():
        return model_dir
    log.info("writing a tiny %s model to %s", options.family, model_dir)
    log_path = options.out_dir / "make-tiny-model.log"
    with log_path.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            *_kvgate("make-tiny-model", str(model_dir), "--family", options.family),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        code = await process.wait()
    if code != 0:
        raise RuntimeError(f"make-tiny-model failed ({code}); see {log_path}")
    return model_dir


def convert_argv(gguf: Path, weights: GgufWeights) -> list[str]:
    """The cached conversion the executor serves: with ``quantized`` weights a directory holding
    the GGUF file itself (the executor keeps its blocks under ``--dtype auto``), with
    ``float32`` a safetensors copy of the dequantized weights."""
    return _kvgate("convert", str(gguf), "--cache", "--dtype", weights.value)


async def ensure_model(options: StackOptions) -> Path:
    """The directory the executor serves: the GGUF file's cached conversion, or a tiny model."""
    if options.model_gguf is None:
        return await ensure_tiny_model(options)
    log_path = options.out_dir / "convert.log"
    with log_path.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(
            *convert_argv(options.model_gguf, options.gguf_weights),
            stdout=subprocess.PIPE,
            stderr=sink,
        )
        stdout, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"converting {options.model_gguf} failed; see {log_path}")
    return Path(stdout.decode().strip().splitlines()[-1])


class ExecutorProcess:
    """``kvgate executor`` as a child process on 127.0.0.1."""

    def __init__(self, options: StackOptions, model_dir: Path) -> None:
        self.options = options
        self.model_dir = model_dir
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = options.out_dir / "executor.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/steps"

    def argv(self) -> list[str]:
        """The ``kvgate executor`` command line."""
        o = self.options
        argv = _kvgate(
            "executor", "--model", str(self.model_dir), "--host", "127.0.0.1",
            "--port", str(self.port), "--device", "cpu", "--num-blocks", str(o.num_blocks),
            "--block-size", str(o.block_size), "--host-snapshot-blocks",
            str(o.host_snapshot_blocks), "--executor-id", "executor-0", "--no-calibrate",
        )  # fmt: skip
        if o.executor_batch_invariant:
            argv.append("--batch-invariant")
        return [*argv, "--activations", o.activations.value]

    def start(self) -> None:
        o = self.options
        argv = self.argv()
        env = dict(os.environ, KVGATE_EXECUTOR_TOKEN=self.token, OTEL_SDK_DISABLED="true")
        # The count chosen by tuning.executor_threads (--threads > OMP_NUM_THREADS > the
        # machine), which already honoured this process's OMP_NUM_THREADS.
        env["OMP_NUM_THREADS"] = str(o.executor_threads)
        with self.log_path.open("wb") as sink:
            # Its own session: Ctrl-C reaches only the service, which stops it in order.
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.executor_ready_timeout_s
        url = f"http://127.0.0.1:{self.port}/readyz"
        async with aiohttp.ClientSession() as http:
            while True:
                if self._process is None or self._process.poll() is not None:
                    raise RuntimeError(f"the executor exited; see {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the executor was not ready in time; see {self.log_path}")
                await asyncio.sleep(0.2)

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited; None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _admin_token_file(options: StackOptions) -> Path:
    """A fresh admin token in a file only its owner can read (never printed)."""
    path = options.out_dir / "admin-token"
    options.out_dir.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(16))
    return path


def stack_settings(
    bootstrap: str, executor: ExecutorProcess, options: StackOptions, **overrides: Any
) -> ServiceSettings:
    """The service's settings, in three layers (``tuning.py``): the stack's defaults, beneath
    the ``KVGATE_*`` variables; what the stack owns (addresses and tokens: a variable naming
    one is refused by ``refuse_owned_variables``), the flags (``options.scheduler``) and
    ``overrides``, above them."""
    tokenizer = executor.model_dir / "tokenizer.json"
    scheduler = scheduler_defaults(options.scheduler_defaults, options.scheduler)
    defaults: dict[str, Any] = {
        "kafka": {
            "partitions": 2,
            "exactly_once": "off",  # Tansu has no transactions
            "session_timeout_ms": 2000,
            "heartbeat_interval_ms": 500,
            "commit_interval_ms": 50,
            "fetch_max_wait_ms": TANSU_FETCH_MAX_WAIT_MS,
        },
        "scheduler": scheduler.settings(),
        "admin": {"host": "127.0.0.1", "port": 0},
        "executors": {"step_timeout_s": 60},
        "limits": {"tokenizer_file": str(tokenizer)} if tokenizer.is_file() else {},
        "shutdown": {"grace_period_s": 5},
    }
    chosen: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap_servers": bootstrap},
        "scheduler": options.scheduler.settings(),
        "admin": {"token_file": str(_admin_token_file(options))},
        "executors": {
            "token": executor.token,
            "members": [{"name": "executor-0", "endpoint": executor.endpoint}],
        },
    }
    for section, changes in overrides.items():
        chosen[section] = {**chosen.get(section, {}), **changes}
    for line in overridden({"scheduler": chosen["scheduler"]}):
        log.info("%s", line)
    return load_settings(None, chosen, defaults=defaults)


class LocalStack:
    """Broker, executor and service; ``async with LocalStack(options) as stack``."""

    def __init__(self, options: StackOptions, **settings_overrides: Any) -> None:
        self.options = options
        self._overrides = settings_overrides
        self.broker = EmbeddedBroker(
            EmbeddedBrokerSettings(port=options.broker_port, log_path=options.out_dir / "tansu.log")
        )
        self.executor: ExecutorProcess | None = None
        self.service: AdmissionService | None = None

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    async def __aenter__(self) -> LocalStack:
        refuse_owned_variables()  # before anything starts
        self.options.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self.broker.start_async()
            model_dir = await ensure_model(self.options)
            self.executor = ExecutorProcess(self.options, model_dir)
            self.executor.start()
            settings = stack_settings(
                self.bootstrap, self.executor, self.options, **self._overrides
            )
            members = settings.executors.members
            # The service joins Kafka while the executor loads; it gets the executor once the
            # executor is ready (as the operator would push it through the admin API).
            quiet = settings.model_copy(
                update={"executors": settings.executors.model_copy(update={"members": []})}
            )
            self.service = AdmissionService(quiet, timeline_steps=self.options.timeline_steps)
            await asyncio.gather(self.service.start(), self.executor.wait_ready())
            assert self.service.engine is not None
            await self.service.engine.set_members(members)
            tune_garbage_collector()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stopped(self) -> str | None:
        """Why the stack stopped serving on its own (the service failed, the executor exited),
        or None while it serves."""
        if self.service is not None and self.service.failure is not None:
            return f"the admission service failed: {self.service.failure!r}"
        if self.executor is not None and self.executor.returncode is not None:
            code = self.executor.returncode
            return f"the executor exited with status {code}; see {self.executor.log_path}"
        return None

    async def close(self) -> None:
        if self.service is not None:
            await self.service.shutdown()
            self.service = None
        if self.executor is not None:
            await asyncio.to_thread(self.executor.stop)
            self.executor = None
        self.broker.stop()


def local_gateway_settings(
    service: ServiceSettings, bootstrap: str, port: int, batch_dir: Path | None = None
) -> GatewaySettings:
    """A gateway for this stack: loopback only, so no API key is asked for; with
    ``batch_dir``, /v1/files and /v1/batches on files under it, fed in this process."""
    kafka = service.kafka
    route = ModelRoute(
        name=service.telemetry.model_name,
        request_topic=kafka.request_topic,
        result_topic=kafka.result_topic,
        tokenizer_file=service.limits.tokenizer_file,
    )
    return GatewaySettings(
        kafka=KafkaConnection(bootstrap_servers=bootstrap), host="127.0.0.1", port=port,
        open_health=True, replica_id="local", abort_topic=kafka.abort_topic, models=[route],
        allow_anonymous=True, reply_fetch_max_wait_ms=TANSU_FETCH_MAX_WAIT_MS,
        batches=None if batch_dir is None else local_batch_settings(batch_dir, kafka.partitions),
    )  # fmt: skip


def local_batch_settings(batch_dir: Path, partitions: int) -> BatchSettings:
    """Batches on one machine: files under ``batch_dir``, the group timings Tansu needs."""
    return BatchSettings(
        store=StoreSettings(kind=StoreKind.LOCAL, path=batch_dir), partitions=partitions,
        session_timeout_ms=2000, heartbeat_interval_ms=500,
        fetch_max_wait_ms=TANSU_FETCH_MAX_WAIT_MS,
    )  # fmt: skip
