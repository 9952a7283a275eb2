"""The paged, batched, chunked executor generates exactly what the unpaged one-request-at-a-time
reference generates (token ids and exit depths), for both model families, under every way a plan
can cut the work: chunked and wavefront fills, mixed and refill batches, async plans with
placeholder rows, snapshot swap-out/in and recompute restores in the middle of decoding."""

from __future__ import annotations

import random

import pytest
import torch

from kvgate.executor.executor import Executor
from kvgate.executor.loader import LoadedModel
from kvgate.protocol import step as wire
from kvgate.protocol.enums import ExitPolicy
from tests.executor.driver import Driver, DriverConfig
from tests.executor.workloads import mixed_requests, reference_outputs

SCENARIOS = {
    "chunked": DriverConfig(chunk_size=5),
    "one-token-chunks": DriverConfig(chunk_size=1, shuffle_seed=3),
    "wavefront": DriverConfig(chunk_size=4, wavefront=True),
    "refill": DriverConfig(chunk_size=7, mixed=False),
    "async": DriverConfig(chunk_size=6, async_plans=True),
    "swap": DriverConfig(chunk_size=5, swap_after={"req-0-0": 2, "req-0-2": 4, "req-0-3": 1}),
    "recompute": DriverConfig(
        chunk_size=5, recompute_after={"req-0-1": 3, "req-0-3": 2, "req-0-4": 5}
    ),
    "async-wavefront-swap-recompute": DriverConfig(
        chunk_size=4,
        wavefront=True,
        async_plans=True,
        swap_after={"req-0-0": 3, "req-0-5": 2},
        recompute_after={"req-0-1": 2, "req-0-4": 4},
    ),
}


def _executor(loaded: LoadedModel, policy: ExitPolicy = ExitPolicy.GATE) -> Executor:
    return Executor(
        loaded, num_blocks=400, block_size=4, host_snapshot_blocks=200, exit_policy=policy
    )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_executor_matches_reference(family_model: LoadedModel, scenario: str) -> None:
    requests = mixed_requests(family_model, count=6, seed=0)
    expected = reference_outputs(family_model, requests)
    executor = _executor(family_model)
    driver = Driver(executor, requests, SCENARIOS[scenario])

    assert driver.run() == expected
    # Nothing leaks: every request and snapshot is gone, host blocks returned.
    assert executor.counters == wire.ExecutorCounters()
    assert executor.blocks_used == 0
    assert driver.max_rows_seen > 1  # requests really shared steps


def test_scenarios_exercise_what_they_name(looped: LoadedModel) -> None:
    """Guards the scenarios themselves: the moves they name actually happen in their plans."""
    requests = mixed_requests(looped, count=6, seed=0)
    driver = Driver(_executor(looped), requests, SCENARIOS["async-wavefront-swap-recompute"])
    plans: list[wire.StepPlan] = []
    original = driver.ex.execute

    def recording(plan: wire.StepPlan) -> wire.StepResult:
        plans.append(plan)
        return original(plan)

    driver.ex.execute = recording  # type: ignore[method-assign]
    driver.run()
    assert sum(len(p.swap_out) for p in plans) == 2
    assert sum(len(p.swap_in) for p in plans) == 2
    assert sum(1 for p in plans for r in p.new_requests if r.output_token_ids) == 2
    # Wavefront: some step runs two chunks of one request at different depths.
    assert any(
        len({(r.request_id, r.depth_first) for r in p.prefill_rows})
        > len({r.request_id for r in p.prefill_rows})
        for p in plans
    )
    assert any(p.prefill_rows and p.decode.request_ids for p in plans)  # mixed steps
    assert all(pos is None for p in plans for pos in p.decode.positions)  # async placeholders
    # Decode rows of one step run at different depths.
    depth_sets = [set(r.decode.depths) for r in driver.results]
    assert any(len(depths) > 1 for depths in depth_sets)
    # Some tokens exited early, some ran every loop: both LAST_EXITED paths are covered.
    depths = {d for _, ds in driver.outputs().values() for d in ds[1:]}
    assert {1, 2, 3} <= depths


def test_fixed_policy_runs_every_loop(looped: LoadedModel) -> None:
    requests = [
        (r.model_copy(update={"loops": wire.LoopParams()}), arrival)
        for r, arrival in mixed_requests(looped, count=3, seed=4)
    ]
    expected = reference_outputs(looped, requests, ExitPolicy.FIXED)
    driver = Driver(_executor(looped, ExitPolicy.FIXED), requests, DriverConfig(chunk_size=6))
    outputs = driver.run()
    assert outputs == expected
    assert all(set(depths) == {3} for _, depths in outputs.values())


def test_exit_trace_forces_depths(looped: LoadedModel) -> None:
    trace = [3, 1, 2, 2, 3, 1]
    request = wire.NewRequest(
        request_id="traced",
        prompt_token_ids=[5, 6, 7],
        sampling=wire.SamplingParams(max_tokens=6),
        loops=wire.LoopParams(exit_trace=trace, exit_threshold=0.0),
    )
    driver = Driver(_executor(looped), [(request, 1)], DriverConfig(chunk_size=2))
    outputs, depths = driver.run()["traced"]
    assert depths == trace
    assert (outputs, depths) == reference_outputs(looped, [(request, 1)])["traced"]


def test_fill_after_a_shared_cached_prefix(family_model: LoadedModel) -> None:
    """A fill may start after a block-aligned prefix whose K/V sits in blocks another request
    owns (prefix caching): the second request reads them, never writes them."""
    loops = family_model.model.num_loops
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]  # two 4-token blocks
    first = wire.NewRequest(request_id="first", prompt_token_ids=[*prefix, 3, 4])
    second = wire.NewRequest(
        request_id="second",
        prompt_token_ids=[*prefix, 9, 9, 9],
        sampling=wire.SamplingParams(max_tokens=5),
    )
    ex = _executor(family_model)
    tables_first = [[10 * d + i for i in range(3)] for d in range(loops)]
    shared = [table[:2] for table in tables_first]
    tables_second = [[*table, 100 + d, 110 + d] for d, table in enumerate(shared)]

    def fill(request: wire.NewRequest, tables: list[list[int]], start: int, step: int) -> None:
        plan = wire.StepPlan(
            step_id=step,
            new_requests=[request],
            block_appends=[wire.BlockAppend(request_id=request.request_id, new_block_ids=tables)],
            prefill_rows=[
                wire.PrefillRow(
                    request_id=request.request_id,
                    token_start=start,
                    token_end=len(request.prompt_token_ids),
                    depth_first=1,
                    depth_last=loops,
                    completes_fill=True,
                )
            ],
        )
        assert ex.execute(plan).error is None

    fill(first, tables_first, 0, 1)
    shared_keys = ex.cache.keys[[b for t in shared for b in t]].clone()
    fill(second, tables_second, len(prefix), 2)
    assert torch.equal(ex.cache.keys[[b for t in shared for b in t]], shared_keys)
    assert ex.blocks_used == 5 * loops  # the shared pages count once
    tokens = [ex._requests["second"].outputs[0]]
    depths = [ex._requests["second"].exit_depths[0]]
    step = 3
    while len(tokens) < 5:
        decode = wire.DecodeRows(request_ids=["second"], positions=[None], depths=[None])
        result = ex.execute(wire.StepPlan(step_id=step, decode=decode))
        assert result.error is None
        tokens += [t.token_id for t in result.sampled_tokens()]
        depths += [t.exit_depth for t in result.sampled_tokens()]
        step += 1
    assert (tokens, depths) == reference_outputs(family_model, [(second, 1)])["second"]


def test_a_fill_cannot_start_inside_a_block(llama: LoadedModel) -> None:
    request = wire.NewRequest(request_id="r", prompt_token_ids=list(range(1, 10)))
    plan = wire.StepPlan(
        step_id=1,
        new_requests=[request],
        block_appends=[wire.BlockAppend(request_id="r", new_block_ids=[[0, 1, 2]])],
        prefill_rows=[
            wire.PrefillRow(request_id="r", token_start=6, token_end=9, depth_first=1, depth_last=1)
        ],
    )
    result = _executor(llama).execute(plan)
    assert result.error is not None and "block boundary" in result.error.message


@pytest.mark.parametrize("seed", range(1, 7))
def test_random_plan_shapes_match_reference(family_model: LoadedModel, seed: int) -> None:
    """Random mixes of chunk size, wavefront, batching, async plans and preemptions."""
    rng = random.Random(seed)
    requests = mixed_requests(family_model, count=7, seed=seed, max_arrival=8)
    ids = [r.request_id for r, _ in requests]
    config = DriverConfig(
        chunk_size=rng.choice([1, 3, 4, 8, 16]),
        wavefront=rng.random() < 0.5,
        mixed=rng.random() < 0.7,
        async_plans=rng.random() < 0.5,
        max_rows=rng.choice([2, 4, 64]),
        shuffle_seed=seed,
        swap_after={rid: rng.randint(1, 6) for rid in rng.sample(ids, 2)},
        recompute_after={rid: rng.randint(1, 6) for rid in rng.sample(ids, 2)},
        restore_delay=rng.randint(1, 3),
    )
    executor = _executor(family_model)
    assert Driver(executor, requests, config).run() == reference_outputs(family_model, requests)
    assert executor.counters == wire.ExecutorCounters() and executor.blocks_used == 0
