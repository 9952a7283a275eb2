"""Invariant 5, feasibility: a request that cannot fit an empty cache is rejected on arrival with
a reason, never queued forever. So are requests the model cannot serve (too long, bad loop
bounds, an exit trace that does not cover the outputs)."""

from __future__ import annotations

from kvgate.admission_service.scheduler.errors import RequestRejected
from kvgate.admission_service.scheduler.request import RequestSpec
from kvgate.admission_service.scheduler.state import SchedulerState
from kvgate.protocol.capacity import blocks_for, length_problem, positions_needed


def check_feasible(state: SchedulerState, spec: RequestSpec) -> None:
    """Raise ``RequestRejected`` for a request that could never run, even on an empty cache."""
    rid = spec.request_id
    if not spec.prompt_token_ids:
        raise RequestRejected(rid, "the prompt is empty")
    prompt_len, max_tokens = len(spec.prompt_token_ids), spec.sampling.max_tokens
    problem = length_problem(prompt_len, max_tokens, state.model.max_model_len)
    if problem is not None:
        raise RequestRejected(rid, problem)
    capacity = positions_needed(prompt_len, max_tokens)
    blocks = blocks_for(
        prompt_len, max_tokens, block_size=state.cache.block_size, num_planes=state.num_planes
    )
    if blocks > state.cache.num_blocks:
        raise RequestRejected(
            rid,
            f"needs {blocks} KV blocks ({capacity} tokens × {state.num_planes} planes at "
            f"block size {state.cache.block_size}) but the whole cache has "
            f"{state.cache.num_blocks}",
        )
    loops = spec.loops
    if loops.min_loops > state.num_planes:
        raise RequestRejected(
            rid, f"min_loops ({loops.min_loops}) exceeds the model's {state.num_planes} loops"
        )
    if loops.exit_trace is not None:
        _check_trace(state, spec)


def _check_trace(state: SchedulerState, spec: RequestSpec) -> None:
    trace = spec.loops.exit_trace or []
    r = state.num_planes
    top = min(spec.loops.max_loops or r, r)
    if len(trace) < spec.sampling.max_tokens:
        raise RequestRejected(
            spec.request_id,
            f"exit_trace has {len(trace)} depths for max_tokens {spec.sampling.max_tokens}",
        )
    if trace[0] != r:
        raise RequestRejected(
            spec.request_id, f"exit_trace[0] must be the full depth {r} (the prompt's pass)"
        )
    bad = [d for d in trace[1:] if not spec.loops.min_loops <= d <= top]
    if bad:
        raise RequestRejected(
            spec.request_id,
            f"exit_trace depths {bad[:4]} outside [{spec.loops.min_loops}, {top}]",
        )
