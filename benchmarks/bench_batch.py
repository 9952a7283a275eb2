"""A batch below interactive traffic, on a simulated executor: what the batch costs interactive
requests, how long it takes, and how long its lines wait against the bound the scheduler gives.

    PYTHONPATH=. python benchmarks/bench_batch.py [--lines 10000] [--window 32] [--load 0.85]
        [--background-step-tokens 32 | --no-background] [--seed 1] [--json]

One executor (the real scheduler over ``CountingExecutor``, which follows its plans and samples
tokens as hashes: the scheduler's decisions are the real ones, at a fraction of ``SimExecutor``'s
cost) runs in simulated time: each step takes ``overhead + prefill tokens x c_p + decode rows x
c_d`` (a device busy in proportion to the work of a step; ``StepCost``). Capacity is measured
first in the same run: interactive requests all queued at once, requests finished per second.
Then two runs over the same interactive arrivals (Poisson at ``load`` x capacity, priority 0, for
as long as the batch runs):

- ``alone``: interactive only;
- ``with batch``: plus a batch of ``lines`` lines at the batch class (priority 100, the
  scheduler's background class unless ``--no-background``), fed as the
  feeder feeds it — ``window`` lines outstanding, the next one sent when an answer comes
  (``feed_delay_s`` later: the reply's and the next request's trip through Kafka).

Reported: interactive time to first token p50/p99 in both runs (the goal: p99 within 10 %), the
batch's completion time (and what it would take alone), and for the batch lines: the longest wait
from being sent to first being admitted, the most bypasses (``max_admission_bypasses`` is the
bound: invariant 2), and the most distinct batch lines started ahead of a waiting line against
its bound ``window - 1 + max_admission_bypasses`` (fewer than ``window`` sent before it; at most
``max_admission_bypasses`` after it) — interactive requests go ahead of every batch line, by
design, and are counted separately.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.protocol.step import LoopParams, SamplingParams
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.events import FinishedEvent, StepReport, TokenEvent
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.sim.cluster import StepCost
from kvgate.sim.counting_executor import CountingExecutor

INTERACTIVE, BATCH = 0, 100  # priorities (lower is more important)
OnFinish = Callable[[str, float], None]
Stop = Callable[[], bool]
NUM_BLOCKS, BLOCK_SIZE = 4096, 16  # 65,536 tokens of KV
SCHEDULER = SchedulerConfig(
    max_num_seqs=64, max_num_batched_tokens=2048, prefill_chunk_size=512, async_scheduling=False
)


@dataclass(frozen=True, slots=True)
class Shape:
    interactive_prompt: tuple[int, int] = (64, 512)
    interactive_output: tuple[int, int] = (16, 128)
    batch_prompt: tuple[int, int] = (128, 768)
    batch_output: tuple[int, int] = (8, 32)


@dataclass(slots=True)
class Line:
    """What is known of one request in a run."""

    arrival_s: float
    priority: int
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    bypasses: int = 0
    preemptions: int = 0
    batch_ahead: set[str] = field(default_factory=set)  # batch lines started while it waited
    interactive_ahead: int = 0


class Requests:
    """Interactive arrivals (a seeded Poisson stream, made as far as asked) and batch lines."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        self._interactive: list[tuple[float, RequestSpec]] = []

    def spec(self, rid: str, rng: random.Random, priority: int) -> RequestSpec:
        shape = self.shape
        batch = priority == BATCH
        prompt = shape.batch_prompt if batch else shape.interactive_prompt
        out = shape.batch_output if batch else shape.interactive_output
        length = rng.randint(*prompt)
        return RequestSpec(
            request_id=rid,
            prompt_token_ids=tuple(rng.randrange(1, 250) for _ in range(length)),
            sampling=SamplingParams(max_tokens=rng.randint(*out), seed=0, ignore_eos=True),
            loops=LoopParams(),
            priority=priority,
        )

    def interactive(self, rate_per_s: float, until_s: float) -> list[tuple[float, RequestSpec]]:
        """The stream's arrivals up to ``until_s`` (the same prefix for every caller)."""
        at = self._interactive[-1][0] if self._interactive else 0.0
        while at < until_s:
            at += self._rng.expovariate(rate_per_s)
            spec = self.spec(f"i{len(self._interactive)}", self._rng, INTERACTIVE)
            self._interactive.append((at, spec))
        return [a for a in self._interactive if a[0] <= until_s]

    def batch_line(self, index: int) -> RequestSpec:
        return self.spec(f"b{index}", random.Random(index * 7919 + 11), BATCH)


class Run:
    """One executor in simulated time; arrivals at given times, batch lines fed by answers."""

    def __init__(self, cost: StepCost, config: SchedulerConfig = SCHEDULER) -> None:
        self.cost = cost
        self.scheduler = Scheduler(
            config,
            CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, host_snapshot_blocks=1024),
            ModelShape(num_loops=1),
        )
        self.executor = CountingExecutor(
            name="e0", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, host_snapshot_blocks=1024
        )
        self.lines: dict[str, Line] = {}
        self._waiting_batch: dict[str, Line] = {}  # sent, never admitted
        self._arrivals: list[tuple[float, int, RequestSpec]] = []
        self._seq = 0
        self.now = 0.0
        self.busy_s = 0.0
        self.steps = 0

    def submit(self, at_s: float, spec: RequestSpec) -> None:
        heapq.heappush(self._arrivals, (at_s, self._seq, spec))
        self._seq += 1

    def run(self, on_finish: OnFinish | None = None, stop: Stop | None = None) -> None:
        """Until nothing is left to do, or ``stop()`` holds (checked before every step)."""
        while stop is None or not stop():
            while self._arrivals and self._arrivals[0][0] <= self.now:
                at, _, spec = heapq.heappop(self._arrivals)
                self.scheduler.add_request(spec, now=at)
                line = self.lines[spec.request_id] = Line(at, spec.priority)
                if spec.priority == BATCH:
                    self._waiting_batch[spec.request_id] = line
            if self.scheduler.has_work:
                plan = self.scheduler.schedule(self.now)
                report = self.scheduler.last_report
                self._admitted(report)
                if plan is not None:
                    result = self.executor.execute(plan)
                    spent = self.cost.seconds(report)
                    self.now += spent
                    self.busy_s += spent
                    self.steps += 1
                    events = self.scheduler.apply(result)
                    for event in [*events, *self.scheduler.pop_events()]:
                        self._event(event, on_finish)
                    continue
                self.now += self.cost.overhead_s  # nothing plannable: let waits run out
                continue
            if not self._arrivals:
                return
            self.now = max(self.now, self._arrivals[0][0])

    def _admitted(self, report: StepReport) -> None:
        for rid, _kind in report.admitted:
            line = self.lines[rid]
            if line.admitted_s is None:
                line.admitted_s = self.now
                self._waiting_batch.pop(rid, None)
            for other in self._waiting_batch.values():
                if line.priority == BATCH:
                    other.batch_ahead.add(rid)
                else:
                    other.interactive_ahead += 1

    def _event(self, event: object, on_finish: OnFinish | None) -> None:
        if isinstance(event, TokenEvent):
            line = self.lines[event.request_id]
            if line.first_token_s is None:
                line.first_token_s = self.now
        elif isinstance(event, FinishedEvent):
            line = self.lines[event.request_id]
            line.finished_s = self.now
            line.bypasses = event.stats.bypasses
            line.preemptions = event.stats.preemptions
            if on_finish is not None:
                on_finish(event.request_id, self.now)


def capacity_per_s(shape: Shape, cost: StepCost, count: int = 1500) -> float:
    """Interactive requests finished per second with all of them queued at once."""
    run = Run(cost)
    probe = Requests(shape, 999)
    rng = random.Random(5)
    for index in range(count):
        run.submit(0.0, probe.spec(f"c{index}", rng, INTERACTIVE))
    run.run()
    return count / run.now


class Feeder:
    """The batch feeder's rule in simulated time: ``window`` lines at once, then the next
    line ``delay_s`` after each answer."""

    def __init__(self, run: Run, requests: Requests, lines: int, window: int, delay_s: float):
        self.run, self.requests, self.lines, self.delay_s = run, requests, lines, delay_s
        self.sent = self.finished = 0
        for _ in range(window):
            self._send(0.0)

    def _send(self, at_s: float) -> None:
        if self.sent < self.lines:
            self.run.submit(at_s, self.requests.batch_line(self.sent))
            self.sent += 1

    def on_finish(self, request_id: str, now_s: float) -> None:
        if request_id.startswith("b"):
            self.finished += 1
            self._send(now_s + self.delay_s)

    @property
    def done(self) -> bool:
        return self.finished >= self.lines


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.85, help="interactive load / capacity")
    parser.add_argument("--feed-delay-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--background-step-tokens",
        type=int,
        default=SchedulerConfig().background_step_tokens,
        help="the background class's passes per step beside interactive work",
    )
    parser.add_argument(
        "--no-background", action="store_true", help="batch lines as an ordinary priority class"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    cost, shape = StepCost(), Shape()
    capacity = capacity_per_s(shape, cost)
    rate = args.load * capacity
    requests = Requests(shape, args.seed)
    delay_s = args.feed_delay_ms / 1000

    # With the batch: interactive arrivals go on for as long as the batch runs.
    background = None if args.no_background else BATCH
    config = SCHEDULER.model_copy(
        update={
            "background_priority": background,
            "background_step_tokens": args.background_step_tokens,
        }
    )
    with_batch = Run(cost, config)
    feeder = Feeder(with_batch, requests, args.lines, args.window, delay_s)
    horizon = 0.0
    while not feeder.done:
        added = [a for a in requests.interactive(rate, horizon + 30.0) if a[0] > horizon]
        for at, spec in added:
            with_batch.submit(at, spec)
        horizon += 30.0
        end = horizon
        with_batch.run(feeder.on_finish, stop=lambda end=end: feeder.done or with_batch.now >= end)
    batch_end_s = with_batch.now
    with_batch.run()  # interactive requests that arrived before the end finish

    # Alone: the same interactive arrivals, up to the batch's end.
    alone = Run(cost)
    for at, spec in requests.interactive(rate, batch_end_s):
        alone.submit(at, spec)
    alone.run()

    # The batch without interactive traffic.
    batch_only = Run(cost, config)
    alone_feeder = Feeder(batch_only, requests, args.lines, args.window, delay_s)
    batch_only.run(alone_feeder.on_finish)

    def ttft(run: Run) -> list[float]:
        return [
            line.first_token_s - line.arrival_s
            for line in run.lines.values()
            if line.priority == INTERACTIVE
            and line.arrival_s <= batch_end_s
            and line.first_token_s is not None
        ]

    alone_ttft, with_ttft = ttft(alone), ttft(with_batch)
    batch_lines = [line for line in with_batch.lines.values() if line.priority == BATCH]
    waits = [line.admitted_s - line.arrival_s for line in batch_lines if line.admitted_s]
    bound = args.window - 1 + SCHEDULER.max_admission_bypasses
    report = {
        "background_step_tokens": None if background is None else args.background_step_tokens,
        "capacity_requests_per_s": round(capacity, 2),
        "interactive_rate_per_s": round(rate, 2),
        "interactive_requests": len(with_ttft),
        "ttft_alone_p50_ms": round(1000 * statistics.median(alone_ttft), 1),
        "ttft_alone_p99_ms": round(1000 * percentile(alone_ttft, 0.99), 1),
        "ttft_with_batch_p50_ms": round(1000 * statistics.median(with_ttft), 1),
        "ttft_with_batch_p99_ms": round(1000 * percentile(with_ttft, 0.99), 1),
        "batch_lines": len(batch_lines),
        "batch_completion_s": round(batch_end_s, 1),
        "batch_alone_completion_s": round(batch_only.now, 1),
        "batch_line_wait_p50_s": round(statistics.median(waits), 3),
        "batch_line_wait_max_s": round(max(waits), 3),
        "batch_line_bypasses_max": max(line.bypasses for line in batch_lines),
        "bypass_bound": SCHEDULER.max_admission_bypasses,
        "batch_lines_started_ahead_max": max(len(line.batch_ahead) for line in batch_lines),
        "batch_lines_ahead_bound": bound,
        "interactive_started_ahead_max": max(line.interactive_ahead for line in batch_lines),
        "batch_line_preemptions": sum(line.preemptions for line in batch_lines),
        "utilization_with_batch": round(with_batch.busy_s / with_batch.now, 3),
        "wall_s": round(time.monotonic() - started, 1),
    }
    p99_ratio = report["ttft_with_batch_p99_ms"] / report["ttft_alone_p99_ms"]
    report["ttft_p99_ratio"] = round(p99_ratio, 3)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:34s} {value}")
    ok = report["batch_line_bypasses_max"] <= report["bypass_bound"] and (
        report["batch_lines_started_ahead_max"] <= bound
    )
    return 0 if ok and len(batch_lines) == args.lines else 1


if __name__ == "__main__":
    raise SystemExit(main())
