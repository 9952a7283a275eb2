"""The simulated executor's CPU per step, in process, as its step server runs it.

    PYTHONPATH=. python benchmarks/bench_sim_executor.py [--requests N] [--prompt N]
        [--max-tokens N] [--rows N] [--rounds N]

A workload of ``--requests`` requests of ``--prompt`` + ``--max-tokens`` tokens runs through the
scheduler and ``SimExecutor`` (``kvgate.sim.runner.run_once``); each plan is written to JSON and
parsed back, executed, and its result written for step protocol 2, as the step server does.
Printed per round: the CPU time of parsing, executing and writing per step, and of executing
per decode-only step (the steady state of a GPU's stand-in). To compare two trees, run this
file from each checkout (its imports come from the tree it is run in).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.protocol import step as wire
from kvgate.sim.runner import run_once, sim_executor
from kvgate.sim.workload import parse_workload


class _Timed:
    """The executor behind the server's JSON round trip, timing each part."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.info = inner.info
        self.cpu = {"parse": 0.0, "execute": 0.0, "write": 0.0, "decode_execute": 0.0}
        self.steps = self.decode_steps = 0

    @property
    def counters(self) -> wire.ExecutorCounters:
        return self._inner.counters  # type: ignore[no-any-return]

    def execute(self, plan: wire.StepPlan) -> wire.StepResult:
        text = plan.model_dump_json()
        t0 = time.process_time()
        parsed = wire.StepPlan.model_validate_json(text)
        t1 = time.process_time()
        result = self._inner.execute(parsed)
        t2 = time.process_time()
        result.to_json(wire.PROTOCOL_VERSION)
        t3 = time.process_time()
        self.cpu["parse"] += t1 - t0
        self.cpu["execute"] += t2 - t1
        self.cpu["write"] += t3 - t2
        self.steps += 1
        if not parsed.prefill_rows:
            self.decode_steps += 1
            self.cpu["decode_execute"] += t2 - t1
        return result  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workload = parse_workload({
        "cache": {"num_blocks": 65536, "block_size": 16},
        "scheduler": {"max_num_seqs": args.rows, "max_num_batched_tokens": args.rows + 2048,
                      "prefill_chunk_size": 2048},
        "requests": [{"id": f"r{i}", "prompt_len": args.prompt, "max_tokens": args.max_tokens,
                      "seed": i} for i in range(args.requests)],
        "model": {"vocab_size": 32000},
    })  # fmt: skip
    decode_ms = []
    for _ in range(args.rounds):
        timed = _Timed(sim_executor(workload))
        result = run_once(workload, executor=timed, check=False, audit=False)
        assert all(o.status == "finished" for o in result.outcomes.values())
        per_step = {
            k: 1000 * v / timed.steps for k, v in timed.cpu.items() if k != "decode_execute"
        }
        decode_ms.append(1000 * timed.cpu["decode_execute"] / max(1, timed.decode_steps))
        print(
            f"{timed.steps} steps: parse {per_step['parse']:.3f} ms, execute "
            f"{per_step['execute']:.3f} ms, write {per_step['write']:.3f} ms per step; "
            f"a decode-only step of up to {args.rows} rows executes in {decode_ms[-1]:.2f} ms "
            f"({timed.decode_steps} such steps)",
            flush=True,
        )
    print(f"median decode-only step: {statistics.median(decode_ms):.2f} ms")


if __name__ == "__main__":
    main()
