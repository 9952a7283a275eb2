"""The scheduler against the real executor in-process: ``kvgate sim --executor real``.

The workload's model section is taken from the checkpoint (loops, vocabulary, end-of-sequence
id). Exit modes map onto the executor's policies: ``fixed`` → every token runs its maximum depth,
``trace`` → each request replays its ``exit_depths``, ``hash`` → the model's own exit gate
decides. The reference is the model's unpaged, one-request-at-a-time generation
(``kvgate.executor.reference``): every request's tokens and exit depths must equal it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.reference import reference_generate
from kvgate.protocol.enums import DType, ExitPolicy
from kvgate.protocol.step import NewRequest
from kvgate.scheduler.strategy import KvgateStrategy, Strategy
from kvgate.sim.report import SimReport, build_report
from kvgate.sim.runner import RequestOutcome, RunResult, arrivals, run_once
from kvgate.sim.simulate import workload_for
from kvgate.sim.workload import ExitMode, Workload, WorkloadError


def fit_to_model(workload: Workload, loaded: LoadedModel) -> Workload:
    config = loaded.model.config
    for request in workload.requests:
        if request.prompt is not None and max(request.prompt) >= config.vocab_size:
            raise WorkloadError(
                f"request {request.id!r}: prompt token ids beyond the model's vocabulary "
                f"({config.vocab_size})"
            )
        if request.exit_depths is not None and request.exit_depths[0] != config.num_loops:
            raise WorkloadError(
                f"request {request.id!r}: exit_depths[0] must be the model's "
                f"{config.num_loops} loops"
            )
    model = workload.model.model_copy(
        update={
            "loops": config.num_loops,
            "min_loops": min(workload.model.min_loops, config.num_loops),
            "vocab_size": config.vocab_size,
            "eos_token_id": config.eos_token_id,
        }
    )
    return workload.model_copy(update={"model": model})


def exit_policy(workload: Workload) -> ExitPolicy:
    return ExitPolicy.GATE if workload.model.exit is ExitMode.HASH else ExitPolicy.FIXED


def reference_run(workload: Workload, loaded: LoadedModel) -> RunResult:
    policy = exit_policy(workload)
    result = RunResult(outcomes={})
    for arrival in arrivals(workload):
        spec = arrival.spec
        generated = reference_generate(
            loaded.model,
            NewRequest(
                request_id=spec.request_id,
                prompt_token_ids=list(spec.prompt_token_ids),
                sampling=spec.sampling,
                loops=spec.loops,
            ),
            policy=policy,
            eos_token_id=loaded.model.config.eos_token_id,
        )
        result.outcomes[spec.request_id] = RequestOutcome(
            spec.request_id,
            "finished",
            output_token_ids=tuple(generated.output_token_ids),
            exit_depths=tuple(generated.exit_depths),
        )
    return result


def simulate_real(
    workload: Workload,
    model_dir: Path,
    *,
    device: str = "cpu",
    strategy: Strategy | None = None,
    check: bool = True,
) -> SimReport:
    loaded = load_model(model_dir, device=device, dtype=DType.FLOAT32)
    workload = fit_to_model(workload, loaded)
    strategy = strategy or KvgateStrategy()
    runs = workload_for(strategy, workload)
    with torch.inference_mode():
        executor = Executor(
            loaded,
            num_blocks=runs.cache.num_blocks,
            block_size=runs.cache.block_size,
            host_snapshot_blocks=runs.cache.host_snapshot_blocks,
            exit_policy=exit_policy(runs),
            device=device,
        )
        run = run_once(runs, strategy=strategy, executor=executor, check=check)
        reference = reference_run(workload, loaded)
    return build_report(strategy.name, run, reference)
