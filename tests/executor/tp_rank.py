"""One rank of a two-process tensor-parallel executor on 127.0.0.1, for the tests.

``python -m tests.executor.tp_rank TASK RANK PORT OUT MODEL_DIR...``

- ``equality``: for each model, rank 0 drives every scenario of ``SCENARIOS`` through the
  tensor-parallel executor and writes the outputs to OUT (JSON); the other rank follows.
- ``die``: rank 1 exits inside its third core pass (mid-step, while rank 0 waits in an
  all-reduce of the same pass); rank 0 writes the errors of that step and the next to OUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from kvgate.executor.model import Model
from kvgate.executor.tensor_parallel.ranks import (
    RankSpec,
    TensorParallelExecutor,
    build_rank_executor,
    follow,
    join_group,
    leave_group,
)
from kvgate.protocol import step as wire
from tests.executor.driver import Driver, DriverConfig
from tests.executor.tp_scenarios import SCENARIOS, tp_requests

DIE_EXIT_CODE = 17


def _spec(rank: int, port: int, model: Path) -> RankSpec:
    return RankSpec(
        rank=rank,
        world_size=2,
        master_port=port,
        model=model,
        device="cpu",
        num_blocks=400,
        block_size=4,
        host_snapshot_blocks=200,
    )


def _die_in_third_pass() -> None:
    original = Model.core_pass
    calls = 0

    def dying(self: Model, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            os._exit(DIE_EXIT_CODE)
        return original(self, *args, **kwargs)

    Model.core_pass = dying  # type: ignore[method-assign]


def main(task: str, rank: int, port: int, out: Path, models: list[Path]) -> int:
    torch.set_num_threads(1)
    parallel, channel = join_group(_spec(rank, port, models[0]))
    outputs: dict[str, Any] = {}
    for model in models:
        executor = build_rank_executor(_spec(rank, port, model), parallel)
        if rank != 0:
            if task == "die":
                _die_in_third_pass()
            follow(executor, channel)
            continue
        backend = TensorParallelExecutor(executor, channel)
        if task == "equality":
            per_scenario = {}
            for name, cfg in SCENARIOS.items():
                requests = tp_requests(executor.model, executor.info.structured_outputs)
                driver = Driver(backend, requests, cfg)  # type: ignore[arg-type]
                per_scenario[name] = driver.run()
                assert executor.counters == wire.ExecutorCounters()
            outputs[model.name] = per_scenario
        else:
            outputs[model.name] = _run_until_failure(backend, executor)
        backend.stop()
    if rank == 0:
        out.write_text(json.dumps(outputs))
    if task == "die":
        # The peer is gone, so the group cannot be torn down cleanly: gloo's threads may still
        # be joinable when they are destroyed, and the process would abort after its report
        # ("terminate called without an active exception", seen once in a clean-clone run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    leave_group()
    return 0


def _run_until_failure(backend: TensorParallelExecutor, executor: Any) -> dict[str, Any]:
    requests = tp_requests(executor.model, executor.info.structured_outputs)
    driver = Driver(backend, requests, DriverConfig(chunk_size=5))  # type: ignore[arg-type]
    errors: list[str] = []
    original = backend.execute

    def recording(plan: wire.StepPlan) -> wire.StepResult:
        result = original(plan)
        if result.error is not None:
            errors.append(result.error.message)
        return result

    backend.execute = recording  # type: ignore[method-assign]
    try:
        driver.run()
    except AssertionError as exc:  # the driver stops at the first rejected step
        errors.append(f"driver stopped: {exc}")
    else:
        errors.append("driver finished: no step failed")
    # The step after the failure is refused at once, without touching a collective.
    errors.append(original(driver._plan()).error.message)  # type: ignore[union-attr]
    return {"errors": errors}


if __name__ == "__main__":
    task, rank, port, out, *models = sys.argv[1:]
    sys.exit(main(task, int(rank), int(port), Path(out), [Path(m) for m in models]))
