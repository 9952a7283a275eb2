"""Request bodies for the scenarios and their references: what each request must produce when
nothing goes wrong (same model, no pressure, one request at a time).

- Real executors: :func:`model_reference` runs the unpaged ``reference_generate`` on the same
  checkpoint the ``kvgate executor`` processes serve.
- Simulated executors: :func:`sim_reference` drives a fresh :class:`SimExecutor` with one request
  per plan sequence (its whole table allocated up front, one prefill, then decode rows), so no
  scheduler is involved at all: the simulated model's tokens are a pure function of the request
  and the block size.
"""

from __future__ import annotations

import random
from typing import Any

from kvgate.protocol import step as wire
from kvgate.sim.backend import SimExecutorConfig

Output = tuple[list[int], list[int]]  # (output token ids, exit depths)

# Greedy and seeded sampling, with and without end-of-sequence stops, shallow and deep exits.
_SAMPLINGS: list[dict[str, Any]] = [
    {"ignore_eos": True, "seed": 1},
    {"temperature": 0.8, "top_k": 20, "seed": 7, "ignore_eos": True},
    {"temperature": 1.1, "top_p": 0.9, "seed": 3},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8, "seed": 11, "ignore_eos": True},
]
# Loop bounds for a model of three or more loops (a one-loop model gets none).
_LOOPS: list[dict[str, Any]] = [
    {"exit_threshold": 0.5},
    {"exit_threshold": 0.6, "min_loops": 2},
    {"max_loops": 2},
    {},
]


def mixed_bodies(
    count: int,
    prefix: str,
    *,
    vocab_size: int,
    num_loops: int = 1,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (4, 28),
    max_tokens: tuple[int, int] = (8, 24),
    priorities: tuple[int, ...] = (0, 1, 2),
) -> list[dict[str, Any]]:
    """``count`` requests of varied lengths, samplings, loop bounds and priorities."""
    rng = random.Random(f"{prefix}/{seed}")
    bodies = []
    for i in range(count):
        length = rng.randint(*prompt_tokens)
        body = {
            "request_id": f"{prefix}{i:05d}",
            "prompt": [rng.randrange(vocab_size - 1) for _ in range(length)],
            "max_tokens": rng.randint(*max_tokens),
            "priority": priorities[i % len(priorities)],
            "sampling": _SAMPLINGS[i % len(_SAMPLINGS)],
        }
        if num_loops >= 3:
            body["loops"] = _LOOPS[(i // len(_SAMPLINGS)) % len(_LOOPS)]
        bodies.append(body)
    return bodies


def new_request(body: dict[str, Any]) -> wire.NewRequest:
    """The executor-side request a body becomes (as the service builds it, without a trace)."""
    sampling = body.get("sampling", {})
    loops = body.get("loops", {})
    return wire.NewRequest(
        request_id=body["request_id"],
        prompt_token_ids=body["prompt"],
        sampling=wire.SamplingParams(max_tokens=body.get("max_tokens", 16), **sampling),
        loops=wire.LoopParams(**loops),
    )


def model_reference(model_dir: Any, bodies: list[dict[str, Any]]) -> dict[str, Output]:
    """Outputs of the unpaged reference on ``model_dir`` (the executors' exit policy: gate)."""
    import torch

    from kvgate.executor.loader import load_model
    from kvgate.executor.reference import reference_generate
    from kvgate.protocol.enums import ExitPolicy

    torch.set_num_threads(1)
    model = load_model(model_dir).model
    eos = model.config.eos_token_id
    out: dict[str, Output] = {}
    for body in bodies:
        ref = reference_generate(model, new_request(body), policy=ExitPolicy.GATE, eos_token_id=eos)
        out[body["request_id"]] = (ref.output_token_ids, ref.exit_depths)
    return out


def sim_reference(bodies: list[dict[str, Any]], config: SimExecutorConfig) -> dict[str, Output]:
    """Outputs of the simulated model for ``config``'s geometry, one request at a time."""
    executor = config.model_copy(update={"num_blocks": 1 << 16}).build()
    planes = executor.num_planes
    eos = config.eos_token_id
    out: dict[str, Output] = {}
    step = 0
    for body in bodies:
        request = new_request(body)
        rid, prompt, sampling = request.request_id, request.prompt_token_ids, request.sampling
        pages = -(-(len(prompt) + sampling.max_tokens) // config.block_size)
        tables = [[plane * pages + page for page in range(pages)] for plane in range(planes)]
        step += 1
        result = executor.execute(
            wire.StepPlan(
                step_id=step,
                new_requests=[request],
                block_appends=[wire.BlockAppend(request_id=rid, new_block_ids=tables)],
                prefill_rows=[
                    wire.PrefillRow(
                        request_id=rid, token_start=0, token_end=len(prompt), depth_first=1,
                        depth_last=planes, completes_fill=True,
                    )
                ],
            )
        )  # fmt: skip
        tokens = list(result.sampled_tokens())
        while not _finished(tokens, sampling, eos):
            step += 1
            decode = wire.DecodeRows(request_ids=[rid], positions=[None], depths=[None])
            result = executor.execute(wire.StepPlan(step_id=step, decode=decode))
            assert result.error is None, result.error
            tokens.extend(result.sampled_tokens())
        step += 1
        executor.execute(wire.StepPlan(step_id=step, free=[rid]))
        out[rid] = ([t.token_id for t in tokens], [t.exit_depth for t in tokens])
    assert executor.counters == wire.ExecutorCounters(), "the reference run leaked"
    return out


def _finished(
    tokens: list[wire.SampledToken], sampling: wire.SamplingParams, eos: int | None
) -> bool:
    if len(tokens) >= sampling.max_tokens:
        return True
    stop = not sampling.ignore_eos and eos is not None
    return stop and bool(tokens) and tokens[-1].token_id == eos
