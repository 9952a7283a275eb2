"""Cost of one scheduler step at steady state: 512 running requests, a long waiting queue.

    python benchmarks/bench_scheduler.py [--steps N] [--growth-reserve-ab]

Times ``schedule()`` + ``apply()`` (the executor is an instant echo, not timed) with block size
16 and mixed prompt/output lengths, for one scheduler with 1,000 and one with 100,000 waiting
requests, stepping them alternately so that noise on a shared machine hits both alike.
Prints median and p99 per step (thread CPU time, so other load on a shared machine does not
inflate it) and the 100k/1k ratio: the scan touches at most ``admission_scan_limit`` waiting
entries, so the cost must not grow with the queue.

``--growth-reserve-ab`` instead steps two schedulers with 1,000 waiting, one with the default
growth reserve and one with it off, and prints the ratio of their medians: what the reserve
costs a step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.protocol.step import (
    DecodeOutcomes,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
)
from kvgate.scheduler.config import (
    CacheConfig,
    ModelShape,
    SchedulerConfig,
)
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler

RUNNING = 512


def _spec(index: int) -> RequestSpec:
    prompt_len = 32 + (index * 37) % 480
    max_tokens = 64 + (index * 53) % 960
    return RequestSpec(
        request_id=f"req-{index}",
        prompt_token_ids=tuple((index + i) % 32000 for i in range(prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _echo(plan: StepPlan) -> StepResult:
    """An instant executor: every fill completes with a token, every decode pass exits."""
    tokens = [
        SampledToken.model_construct(
            request_id=row.request_id, position=row.token_end, token_id=7, exit_depth=1
        )
        for row in plan.prefill_rows
        if row.completes_fill
    ]
    decode = plan.decode
    positions = [p if p is not None else 0 for p in decode.positions]
    tokens.extend(
        SampledToken.model_construct(request_id=rid, position=pos + 1, token_id=7, exit_depth=1)
        for rid, pos in zip(decode.request_ids, positions, strict=True)
    )
    outcomes = DecodeOutcomes.model_construct(
        request_ids=decode.request_ids,
        positions=positions,
        depths=[1] * len(positions),
        exited=[True] * len(positions),
    )
    return StepResult.model_construct(
        step_id=plan.step_id, tokens=tokens, decode=outcomes, skipped_request_ids=[], error=None
    )


class Steady:
    """A scheduler at steady state: 512 running requests in decode, ``waiting`` queued."""

    def __init__(self, waiting: int, **settings: object) -> None:
        self.scheduler = Scheduler(
            SchedulerConfig.model_validate(
                {
                    "max_num_seqs": RUNNING,
                    "max_num_batched_tokens": 8192,
                    "prefill_chunk_size": 2048,
                    "preemption": "recompute",
                    **settings,
                }
            ),
            CacheConfig(num_blocks=RUNNING * 96, block_size=16, enable_prefix_caching=True),
            ModelShape(num_loops=1),
        )
        self.next_index = 0
        for _ in range(RUNNING + waiting):
            self._add()
        for _ in range(40):  # warm up until every slot runs decode
            self.step()
        assert self.scheduler.num_running == RUNNING

    def _add(self) -> None:
        self.scheduler.add_request(_spec(self.next_index))
        self.next_index += 1

    def step(self) -> float:
        """One step; returns the thread CPU time of ``schedule()`` + ``apply()``."""
        clock = time.thread_time  # other processes on a shared machine do not count
        start = clock()
        plan = self.scheduler.schedule(0.0)
        assert plan is not None
        mid = clock()
        result = _echo(plan)
        resume = clock()
        events = self.scheduler.apply(result)
        end = clock()
        finished = sum(1 for e in events if type(e).__name__ == "FinishedEvent")
        for _ in range(finished):  # keep the waiting queue at its size
            self._add()
        return (mid - start) + (end - resume)


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _growth_reserve_ab(steps: int) -> int:
    on, off = Steady(1_000), Steady(1_000, growth_reserve_steps=0)
    gc.collect()
    timings: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(steps):  # alternate, so load from elsewhere hits both alike
        timings["on"].append(on.step())
        timings["off"].append(off.step())
    for label, values in timings.items():
        p99 = statistics.quantiles(values, n=100)[98] * 1e3
        print(
            f"growth reserve {label:>3}: schedule()+apply() median {_median_ms(values):.3f} ms, "
            f"p99 {p99:.3f} ms over {steps} steps"
        )
    ratio = _median_ms(timings["on"]) / _median_ms(timings["off"])
    print(f"ratio on/off median: {ratio:.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--growth-reserve-ab", action="store_true")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.growth_reserve_ab:
        return _growth_reserve_ab(args.steps)
    small, large = Steady(1_000), Steady(100_000)
    gc.collect()
    timings: dict[int, list[float]] = {1_000: [], 100_000: []}
    for _ in range(args.steps):  # alternate, so load from elsewhere hits both alike
        timings[1_000].append(small.step())
        timings[100_000].append(large.step())
    medians = {}
    for waiting, values in timings.items():
        medians[waiting] = statistics.median(values) * 1e3
        p99 = statistics.quantiles(values, n=100)[98] * 1e3
        print(
            f"{RUNNING} running, {waiting:>7} waiting: schedule()+apply() median "
            f"{medians[waiting]:.3f} ms, p99 {p99:.3f} ms over {args.steps} steps"
        )
    print(f"ratio 100k/1k median: {medians[100_000] / medians[1_000]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
