"""The gateway's cost: time to first token and throughput through HTTP versus producing to
Kafka directly, in one run, on the same stack.

    python benchmarks/bench_gateway.py [--requests N] [--concurrency C] [--max-tokens M]

Starts ``kvgate run --tiny`` (embedded broker, the tiny real CPU executor, the admission
service, a gateway on loopback) as a child process. Then the same closed-loop workload (C
workers, N requests in all, M tokens each with ``ignore_eos``, greedy) runs twice per round,
for ``--rounds`` rounds (4), alternating the order:

- direct: the gateway's own Kafka bridge in this process (``ReplyBridge``: produce the record
  with a reply address, read tokens and the result from a reply partition) — what a Kafka
  client that wants streamed tokens does, with no HTTP;
- gateway: the official ``openai`` client streaming ``/v1/completions``.

Time to first token: the request's start to its first token (direct: the first token chunk;
gateway: the stream's response headers, which the gateway sends at the first token).
Throughput: output tokens over the phase's wall time. Ratios are gateway / direct; the medians
over rounds are printed. The machine is shared: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from kvgate.gateway.replies import ReplyBridge
from kvgate.gateway.settings import GatewaySettings, ModelRoute
from kvgate.kafka_connection import KafkaConnection
from kvgate.local.stack import free_port
from kvgate.protocol import topics
from kvgate.protocol.records import InferenceRequest, RequestSampling

PROMPT = "Hello, this is a benchmark prompt."


def start_stack(out: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    kafka, http = free_port(), free_port()
    log = out / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "run", "--tiny", "--gateway-port", str(http),
             "--port", str(kafka), "--out-dir", str(out)],
            env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 240
    while b"OpenAI API" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"kvgate run did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return process, f"127.0.0.1:{kafka}", http


async def direct_phase(
    bootstrap: str, requests: int, concurrency: int, max_tokens: int
) -> tuple[list[float], float, int]:
    settings = GatewaySettings(
        kafka=KafkaConnection(bootstrap_servers=bootstrap),
        replica_id=f"bench-{uuid.uuid4().hex[:6]}",
        models=[ModelRoute(name="kvgate")], allow_anonymous=True,
    )  # fmt: skip
    bridge = ReplyBridge(settings)
    await bridge.start()
    ttfts: list[float] = []
    tokens = 0
    queue = list(range(requests))

    async def worker() -> None:
        nonlocal tokens
        while queue:
            queue.pop()
            rid = f"direct-{uuid.uuid4().hex}"
            waiter, _ = bridge.join(rid)
            request = InferenceRequest(
                request_id=rid, prompt=PROMPT, max_tokens=max_tokens,
                sampling=RequestSampling(ignore_eos=True),
                reply=bridge.reply.model_copy(update={"tokens": True}),
            )  # fmt: skip
            started = time.perf_counter()
            await bridge.send(topics.REQUESTS, request, look_up_in=None)
            await waiter.tokens.get()
            ttfts.append(time.perf_counter() - started)
            result = await waiter.result
            tokens += result.usage.completion_tokens
            bridge.leave(rid, waiter)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - began
    await bridge.close()
    return ttfts, wall, tokens


async def gateway_phase(
    port: int, requests: int, concurrency: int, max_tokens: int
) -> tuple[list[float], float, int]:
    api = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
    )
    ttfts: list[float] = []
    tokens = 0
    queue = list(range(requests))

    async def worker() -> None:
        nonlocal tokens
        while queue:
            queue.pop()
            started = time.perf_counter()
            stream = await api.completions.create(
                model="kvgate", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            ttfts.append(time.perf_counter() - started)
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    async with api:
        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return ttfts, wall, tokens


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        process, bootstrap, port = start_stack(Path(tmp))
        try:
            w = (args.requests, args.concurrency, args.max_tokens)
            await direct_phase(bootstrap, 16, 4, 4)  # warm-up: topics, executor, caches
            await gateway_phase(port, 16, 4, 4)
            ratios: dict[str, list[float]] = {"ttft_p50": [], "ttft_p90": [], "throughput": []}
            for round_ in range(args.rounds):
                order = ["direct", "gateway"] if round_ % 2 == 0 else ["gateway", "direct"]
                figures = {}
                for phase in order:
                    if phase == "direct":
                        figures[phase] = await direct_phase(bootstrap, *w)
                    else:
                        figures[phase] = await gateway_phase(port, *w)
                    ttfts, wall, tokens = figures[phase]
                    print(
                        f"round {round_ + 1} {phase:8s} TTFT p50 {_ms(ttfts, 50):7.1f} ms  "
                        f"p90 {_ms(ttfts, 90):7.1f} ms  {tokens / wall:8.1f} output tokens/s  "
                        f"({len(ttfts)} requests, {wall:.2f} s)",
                        flush=True,
                    )
                d, g = figures["direct"], figures["gateway"]
                ratios["ttft_p50"].append(_ms(g[0], 50) / _ms(d[0], 50))
                ratios["ttft_p90"].append(_ms(g[0], 90) / _ms(d[0], 90))
                ratios["throughput"].append((g[2] / g[1]) / (d[2] / d[1]))
            for name, values in ratios.items():
                print(f"gateway / direct {name:10s} median {statistics.median(values):.2f}  "
                      f"({', '.join(f'{v:.2f}' for v in values)})")  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    asyncio.run(main())
