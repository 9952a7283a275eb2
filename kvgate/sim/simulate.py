"""One call: run a workload, run its reference, report."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from kvgate.scheduler.strategy import KvgateStrategy, Strategy
from kvgate.sim.report import SimReport, build_report
from kvgate.sim.runner import (
    ExecutorFactory,
    RunResult,
    StepObserver,
    run_once,
    sim_executor,
    unconstrained,
)
from kvgate.sim.workload import Workload

ReferenceRun = Callable[[Workload], RunResult]


def simulated_reference(workload: Workload) -> RunResult:
    """The same workload on an unconstrained cache with preemption off."""
    wide = unconstrained(workload)
    return run_once(wide, executor=sim_executor(wide), check=False, audit=False)


def workload_for(strategy: Strategy, workload: Workload) -> Workload:
    """The workload as ``strategy`` runs it. A rule replayed for comparison may adjust the engine
    settings its rules assume (``adapt_workload``: the seed's engine keeps every snapshot in
    host memory with no bound); the reference run keeps the workload as written."""
    adapt = getattr(strategy, "adapt_workload", None)
    if adapt is None:
        return workload
    adapted = adapt(workload)
    if not isinstance(adapted, Workload):
        raise TypeError(f"{strategy.name}.adapt_workload must return a Workload")
    return adapted


def simulate(
    workload: Workload,
    *,
    strategy: Strategy | None = None,
    executor_factory: ExecutorFactory = sim_executor,
    reference: ReferenceRun = simulated_reference,
    check: bool = True,
    audit: bool = True,
    observe: StepObserver | None = None,
) -> SimReport:
    strategy = strategy or KvgateStrategy()
    runs = workload_for(strategy, workload)
    run = run_once(
        runs,
        strategy=strategy,
        executor=executor_factory(runs),
        check=check,
        audit=audit,
        observe=observe,
    )
    return build_report(strategy.name, run, reference(workload))


def load_strategy(target: str) -> Strategy:
    """``MODULE:NAME`` or ``path/to/file.py:NAME``; a class is instantiated."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--admission expects MODULE:NAME, got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
                raise  # the strategy's module exists; something it imports does not
            raise ValueError(
                f"--admission {target}: no module named {exc.name!r} "
                f"(looked in the installed packages and {Path.cwd()})"
            ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r}") from None
    strategy = obj() if isinstance(obj, type) else obj
    if not (hasattr(strategy, "plan_step") and hasattr(strategy, "make_room")):
        raise ValueError(f"{target} is not a scheduling strategy (needs plan_step, make_room)")
    return strategy  # type: ignore[no-any-return]
