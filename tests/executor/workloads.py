"""Request mixes for the executor tests and their unpaged reference outputs."""

from __future__ import annotations

import random

from kvgate.executor.loader import LoadedModel
from kvgate.executor.reference import reference_generate
from kvgate.protocol import step as wire
from kvgate.protocol.enums import ExitPolicy

_SAMPLINGS = [
    wire.SamplingParams(max_tokens=9),
    wire.SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=11),
    wire.SamplingParams(temperature=1.3, top_p=0.9, seed=3, max_tokens=8),
    wire.SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=11, max_tokens=10),
]
_LOOPS = [
    wire.LoopParams(exit_threshold=0.5),
    wire.LoopParams(exit_threshold=0.6, min_loops=2),
    wire.LoopParams(max_loops=2),
    wire.LoopParams(exit_trace=[3, 1, 2, 3, 1, 1, 2]),  # past the trace: the gate decides
]


def mixed_requests(
    loaded: LoadedModel, count: int = 6, seed: int = 0, max_arrival: int = 6
) -> list[tuple[wire.NewRequest, int]]:
    """``count`` requests of different prompt lengths, samplings and loop bounds, arriving over
    the first ``max_arrival`` steps."""
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size
    eos = loaded.model.config.eos_token_id
    out = []
    for i in range(count):
        length = rng.choice([1, 2, 5, 9, 14, 23])
        prompt = [rng.randrange(vocab) for _ in range(length)]
        prompt = [t for t in prompt if t != eos] or [0]
        request = wire.NewRequest(
            request_id=f"req-{seed}-{i}",
            prompt_token_ids=prompt,
            sampling=_SAMPLINGS[i % len(_SAMPLINGS)],
            loops=_LOOPS[(i + seed) % len(_LOOPS)],
        )
        out.append((request, rng.randrange(1, max_arrival + 1)))
    return out


def reference_outputs(
    loaded: LoadedModel,
    requests: list[tuple[wire.NewRequest, int]],
    policy: ExitPolicy = ExitPolicy.GATE,
) -> dict[str, tuple[list[int], list[int]]]:
    eos = loaded.model.config.eos_token_id
    results = {}
    for request, _ in requests:
        ref = reference_generate(loaded.model, request, policy=policy, eos_token_id=eos)
        results[request.request_id] = (ref.output_token_ids, ref.exit_depths)
    return results
