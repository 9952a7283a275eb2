"""The simulated model computed densely, one request at a time, with no block tables at all.

It restates the simulator's value function (see ``kvgate.sim.executor``) over
plain per-plane lists, so the paged simulator, the scheduler and this agree only if every block
table, plane copy, snapshot and recompute was right.
"""

from __future__ import annotations

from kvgate.sim.hashing import mix, text_hash
from kvgate.sim.workload import ExitMode, Workload, WorkloadRequest


def _digest(plane: int, values: list[int], position: int, block_size: int) -> int:
    h = plane
    full_pages, partial = divmod(position, block_size)
    for page in range(full_pages):
        h = mix(h, mix(*values[page * block_size : (page + 1) * block_size]))
    for offset in range(partial):
        h = mix(h, values[full_pages * block_size + offset])
    return h


def generate(workload: Workload, request: WorkloadRequest) -> tuple[list[int], list[int]]:
    model = workload.model
    r = model.loops
    bs = workload.cache.block_size
    tokens = list(request.prompt_tokens(model))
    planes: dict[int, list[int]] = {d: [] for d in range(1, r + 1)}

    def run_position(position: int, exit_depth: int) -> int:
        hidden = mix(model.seed, tokens[position], position)
        for depth in range(1, exit_depth + 1):
            hidden = mix(hidden, depth, _digest(depth, planes[depth], position, bs))
            planes[depth].append(hidden)
        for depth in range(exit_depth + 1, r + 1):
            planes[depth].append(hidden)
        return hidden

    outputs: list[int] = []
    depths: list[int] = []
    value = 0
    for position in range(len(tokens)):
        value = run_position(position, r)
    rid = text_hash(request.id)
    while True:
        position = len(tokens) - 1
        if outputs:
            top = r
            if request.exit_depths is not None:
                exit_depth = request.exit_depths[len(outputs)]
            elif model.exit is ExitMode.FIXED:
                exit_depth = top
            else:
                bottom = min(model.min_loops, top)
                exit_depth = bottom + mix(model.seed, rid, position) % (top - bottom + 1)
            value = run_position(position, exit_depth)
        else:
            exit_depth = r
        token = mix(value, request.seed, position + 1) % model.vocab_size
        outputs.append(token)
        depths.append(exit_depth)
        tokens.append(token)
        eos = model.eos_token_id
        if (eos is not None and token == eos and not request.ignore_eos) or len(
            outputs
        ) >= request.max_tokens:
            return outputs, depths
