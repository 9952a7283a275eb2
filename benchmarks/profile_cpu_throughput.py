"""Where kvgate's CPU time goes on the throughput workload of ``bench_vs_vllm.py``.

    PYTHONPATH=. python benchmarks/profile_cpu_throughput.py [--threads 1] [--rows 30]

The same model, prompts and limits as the benchmark's throughput run (32 requests of the docs'
prose, 64 new tokens each), in this process under ``torch.profiler`` after the same warm-up.
Prints the operators by self time, then the run's wall seconds against the operators' sum (the
profiler's "self CPU" times are wall-clock spans of each operator): the difference is the time
outside torch operators (Python in the model, the runner, the scheduler) plus the profiler's own
cost. On a busy machine both include time the core was held by others.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=30, help="operators to list")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    from torch.profiler import ProfilerActivity, profile

    from benchmarks import bench_vs_vllm as bench

    spec = bench.build_spec(bench._model_dir())
    generate = bench._kvgate_engine(spec)
    generate(spec["prompts"][:4], 4)  # the benchmark's warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began, began_cpu = time.perf_counter(), time.process_time()
        generate(spec["prompts"], bench.NEW_TOKENS)
        wall_s, cpu_s = time.perf_counter() - began, time.process_time() - began_cpu
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    ops_s = sum(event.self_cpu_time_total for event in averages) / 1e6
    print(
        f"run: {wall_s:.2f} s wall ({cpu_s:.2f} CPU s); torch operators: {ops_s:.2f} s; "
        f"outside them: {wall_s - ops_s:.2f} s ({(wall_s - ops_s) / wall_s:.0%} of wall)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
