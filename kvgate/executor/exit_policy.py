"""When a token leaves the loop: the exit decision after each core pass (pure functions).

``max_loops = min(loops.max_loops or R, R)`` always ends a token. Before that:

- ``fixed``: never exit early.
- ``gate``: Ouro's exit gate. Each pass gives a hazard ``h`` (exit probability given no earlier
  exit); ``remaining *= 1 - h``; exit once ``1 - remaining >= exit_threshold`` and at least
  ``min_loops`` passes ran.
- ``trace``: replay given depths — output ``i`` exits after ``exit_trace[i]`` passes. A request
  with an ``exit_trace`` always uses it; past the end of its trace the configured policy applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.protocol.enums import ExitPolicy
from kvgate.protocol.step import LoopParams


@dataclass(frozen=True)
class ExitDecision:
    exited: bool
    remaining: float  # the gate's probability mass not yet spent, carried to the next pass


def max_loops(loops: LoopParams, num_loops: int) -> int:
    return min(loops.max_loops or num_loops, num_loops)


def uses_gate(loops: LoopParams, policy: ExitPolicy, output_index: int, num_loops: int) -> bool:
    """Whether deciding this output's exit needs the gate's hazard."""
    traced = loops.exit_trace is not None and output_index < len(loops.exit_trace)
    return num_loops > 1 and not traced and policy is ExitPolicy.GATE


def decide(
    *,
    depth: int,
    loops: LoopParams,
    policy: ExitPolicy,
    num_loops: int,
    output_index: int,
    remaining: float,
    hazard: float | None,
) -> ExitDecision:
    """Whether the token producing output ``output_index`` exits after its pass at ``depth``.

    ``hazard`` is required exactly when :func:`uses_gate` says so.
    """
    if loops.exit_trace is not None and output_index < len(loops.exit_trace):
        exited = depth >= min(loops.exit_trace[output_index], max_loops(loops, num_loops))
        return ExitDecision(exited, remaining)
    if depth >= max_loops(loops, num_loops):
        return ExitDecision(True, remaining)
    if not uses_gate(loops, policy, output_index, num_loops):
        return ExitDecision(False, remaining)
    if hazard is None:
        raise ValueError("the gate policy needs the pass's hazard")
    remaining *= 1.0 - hazard
    exited = 1.0 - remaining >= loops.exit_threshold and depth >= loops.min_loops
    return ExitDecision(exited, remaining)
