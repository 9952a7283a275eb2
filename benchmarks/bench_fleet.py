"""A pool's control plane on real Kafka: admission replicas against lean executors.

    python benchmarks/bench_fleet.py [--replicas 1,2] [--executors 2,4] [--step-ms 10]
        [--requests N] [--prompt N] [--max-tokens N] [--rows N] [--partitions N] [--stream]
        [--bootstrap HOST:PORT]

For each pair of (replicas, executors): ``executors`` lean executors (``bench_step_path.py``'s,
a child process each: the real step protocol, each step padded to ``--step-ms`` as a GPU's
decode step would be) and ``replicas`` ``kvgate admission-service`` processes in one consumer
group on a request topic of ``--partitions`` partitions (default: 2 per replica), with
exactly-once on. The executors are shared out by the operator's own rules
(``kvgate.operator.shards``) through each replica's admin API, as the operator does. Then
``--requests`` requests per executor of ``--prompt`` + ``--max-tokens`` tokens are produced at
once (keyed by id, spread over the partitions), and the results topic is read until every one
is answered. ``--stream`` adds the token topic (every token streamed).

Printed per configuration, from the first record produced to the last answer read: output
tokens per second, steps per second per executor against the ideal ``1000 / step-ms`` (step
efficiency), the replicas' CPU (all together) per step and in cores, and the ratio of tokens
per second to the same executor count on one replica. Kafka: a broker started from the test
harness's image in Docker (``--bootstrap`` names another). The machine's cores bound what it
shows: the broker, the executors and every replica share them (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from benchmarks.bench_step_path import TOKEN, cpu_seconds, free_port
from kvgate.operator import shards
from kvgate.operator.admin import AdminClient, AdminRejected, AdminUnavailable
from kvgate.operator.reconciler import Shards
from kvgate.protocol.admin import ExecutorSpec

ADMIN_TOKEN = "bench-fleet-admin-token"
STEP_SERVER = Path(__file__).resolve().parent / "bench_step_path.py"


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@contextlib.contextmanager
def _children(log_dir: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for child in started:
            child.terminate()
        for child in started:
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()


def _spawn(started: list[subprocess.Popen[bytes]], argv: list[str], log: Path) -> Any:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env["OTEL_SDK_DISABLED"] = "true"
    with log.open("ab") as sink:
        child = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    started.append(child)
    return child


async def _until(check: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def _share(http: aiohttp.ClientSession, replicas: list[Replica], specs: list[Any]) -> bool:
    """One pass of the operator's sharing; True once every replica drives its shard."""
    observed = []
    for r in replicas:
        try:
            reading = await AdminClient(http, r.url, ADMIN_TOKEN).membership()
        except (AdminUnavailable, AdminRejected):
            observed.append(shards.Replica(r.name, r.url, ready=False))
            continue
        observed.append(shards.Replica(r.name, r.url, ready=True, reading=reading))
    plan = shards.split(specs, observed)
    if len(plan.live) < len(replicas):
        return False
    admins = {r.name: AdminClient(http, r.url, ADMIN_TOKEN) for r in replicas}
    await Shards(plan, observed, admins).send()  # the operator's own two rounds
    if plan.pushes or plan.releases:
        return False
    readings = [o.reading for o in observed if o.reading is not None]
    return all(e.state.value == "ready" for m in readings for e in m.executors)


async def _steps(http: aiohttp.ClientSession, replicas: list[Replica]) -> float:
    total = 0.0
    for r in replicas:
        async with http.get(r.url + "/metrics") as response:
            for line in (await response.text()).splitlines():
                if line.startswith("kvgate_admission_steps_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def run_one(
    args: argparse.Namespace, bootstrap: str, replicas_n: int, executors_n: int, log_dir: Path
) -> dict[str, float]:
    base = f"fleet-{uuid.uuid4().hex[:8]}"
    topics = {k: f"{base}.{k}" for k in ("requests", "results", "aborts", "dlq", "tokens")}
    partitions = args.partitions or 2 * replicas_n
    with _children(log_dir) as started:
        specs = []
        for i in range(executors_n):
            port = free_port()
            argv = [sys.executable, str(STEP_SERVER), "--serve", f"e{i}:{port}:2"]
            _spawn(started, [*argv, "--step-ms", str(args.step_ms)], log_dir / f"e{i}.log")
            specs.append(ExecutorSpec(name=f"e{i}", endpoint=f"ws://127.0.0.1:{port}/v1/steps"))
        replicas = []
        for i in range(replicas_n):
            port = free_port()
            kafka: dict[str, Any] = {
                "bootstrap_servers": bootstrap, "request_topic": topics["requests"],
                "result_topic": topics["results"], "abort_topic": topics["aborts"],
                "dlq_topic": topics["dlq"], "group_id": f"{base}-group",
                "partitions": partitions, "exactly_once": "on",
            }  # fmt: skip
            if args.stream:
                kafka["token_topic"] = topics["tokens"]
            config = {
                "kafka": kafka,
                "scheduler": {"max_num_seqs": args.rows, "max_num_batched_tokens": 8192},
                "admin": {"host": "127.0.0.1", "port": port, "token": ADMIN_TOKEN},
                "executors": {"token": TOKEN, "members": []},
            }
            path = log_dir / f"replica-{i}.json"
            path.write_text(json.dumps(config))
            argv = [sys.executable, "-m", "kvgate", "admission-service", "--config", str(path)]
            process = _spawn(started, argv, log_dir / f"replica-{i}.log")
            replicas.append(Replica(f"replica-{i}", process, port))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:

            async def ready() -> bool:
                for r in replicas:
                    if r.process.poll() is not None:
                        raise RuntimeError(f"{r.name} exited; see {log_dir}")
                    try:
                        async with http.get(r.url + "/readyz") as response:
                            if response.status != 200:
                                return False
                    except aiohttp.ClientError:
                        return False
                return True

            await _until(ready, "every replica ready")
            await _until(lambda: _share(http, replicas, specs), "the executors shared out")
            await _until(lambda: _group_stable(bootstrap, f"{base}-group", replicas_n), "group")
            total = executors_n * args.requests
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
            consumer = AIOKafkaConsumer(
                topics["results"], bootstrap_servers=bootstrap, group_id=None,
                auto_offset_reset="earliest", isolation_level="read_committed",
            )  # fmt: skip
            await producer.start()
            await consumer.start()
            try:
                # One request per partition first, answered before the clock starts: every
                # partition is taken over and every session open.
                for partition in range(partitions):
                    rid = f"{base}-warm-{partition}"
                    body = {"schema_version": 1, "request_id": rid, "prompt": [1, 2, 3],
                            "max_tokens": 1}  # fmt: skip
                    value = json.dumps(body).encode()
                    await producer.send(topics["requests"], value, partition=partition)
                await producer.flush()
                answered: set[bytes] = set()
                while len(answered) < partitions:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        answered.update(r.key for r in records if r.key is not None)
                steps_before = await _steps(http, replicas)
                cpu_before = cpu_seconds([r.process.pid for r in replicas])
                began = time.perf_counter()
                for i in range(total):
                    rid = f"{base}-{i}"
                    body = {
                        "schema_version": 1, "request_id": rid,
                        "prompt": [(i * 31 + k * 7) % 30_000 + 1 for k in range(args.prompt)],
                        "max_tokens": args.max_tokens,
                        "sampling": {"temperature": 0.0, "ignore_eos": True},
                    }  # fmt: skip
                    value = json.dumps(body).encode()
                    await producer.send(topics["requests"], value, key=rid.encode())
                await producer.flush()
                answered.clear()
                while len(answered) < total:
                    batches = await consumer.getmany(timeout_ms=500)
                    for records in batches.values():
                        answered.update(
                            r.key for r in records if r.key is not None and b"-warm-" not in r.key
                        )
                    if time.perf_counter() - began > args.timeout_s:
                        raise RuntimeError(f"{len(answered)} of {total} answered in time")
                wall = time.perf_counter() - began
                cpu = cpu_seconds([r.process.pid for r in replicas]) - cpu_before
                steps = await _steps(http, replicas) - steps_before
            finally:
                await producer.stop()
                await consumer.stop()
    tokens = total * args.max_tokens
    return {
        "tokens_per_s": tokens / wall,
        "steps_per_s_per_executor": steps / wall / executors_n,
        "efficiency": steps / wall / executors_n / (1000 / args.step_ms),
        "cpu_ms_per_step": cpu / steps * 1000 if steps else float("nan"),
        "cores": cpu / wall,
        "wall_s": wall,
    }


async def _group_stable(bootstrap: str, group: str, members: int) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [description] = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    # The raw DescribeGroups answer: (error, group, state, protocol type, protocol, members, ...)
    found = description.groups[0]
    state, listed = found[2], found[5]
    return bool(state == "Stable" and len(listed) == members)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--executors", default="2,4", help="comma-separated executor counts")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=512, help="per executor")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--partitions", type=int, default=0, help="0: two per replica")
    parser.add_argument("--stream", action="store_true", help="stream every token")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--bootstrap", default=None, help="a Kafka to use (default: Docker)")
    args = parser.parse_args()
    replica_counts = [int(x) for x in args.replicas.split(",")]
    executor_counts = [int(x) for x in args.executors.split(",")]
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap
        if bootstrap is None:
            from benchmarks.bench_interactive import real_kafka

            bootstrap = stack.enter_context(real_kafka())
        log_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fleet-")))
        streamed = "streamed" if args.stream else "not streamed"
        print(
            f"cores: {os.cpu_count()}, step {args.step_ms:g} ms, {args.requests} requests per "
            f"executor of {args.prompt}+{args.max_tokens} tokens, {streamed}, exactly-once",
            flush=True,
        )
        for executors_n in executor_counts:
            single = None
            for replicas_n in replica_counts:
                log_dir = log_root / f"r{replicas_n}-e{executors_n}"
                log_dir.mkdir()
                f = asyncio.run(run_one(args, bootstrap, replicas_n, executors_n, log_dir))
                if replicas_n == 1:
                    single = f["tokens_per_s"]
                ratio = f" ({f['tokens_per_s'] / single:.2f}x one replica)" if single else ""
                print(
                    f"{replicas_n} replica(s), {executors_n} executors: "
                    f"{f['tokens_per_s']:,.0f} output tokens/s{ratio}, "
                    f"{f['steps_per_s_per_executor']:.0f} steps/s per executor "
                    f"({f['efficiency']:.0%} of ideal), replicas' CPU "
                    f"{f['cpu_ms_per_step']:.2f} ms per step, {f['cores']:.2f} cores, "
                    f"{f['wall_s']:.1f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
