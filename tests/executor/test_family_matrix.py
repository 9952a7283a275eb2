"""Every dense family (Phi-3 with and without LongRoPE) through the whole matrix (slow tier):
each way a plan can cut the work gives transformers' greedy ids, two gloo ranks give what one
process gives, the batch-invariant mode gives a request its bits in any batch.

The default tier runs each family's core check (test_family_*.py): one batched, chunked run
with a swap and a recompute, both config layouts, log-probabilities.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.executor.executor import Executor
from kvgate.executor.layer_ops import prepare_cpu_kernels
from kvgate.executor.loader import load_model
from tests.executor.driver import Driver, DriverConfig
from tests.executor.family_cases import FAMILIES, WrittenFamilies
from tests.executor.family_checks import SNAPSHOT_BLOCKS, assert_batch_invariant
from tests.executor.hf_checkpoints import kvgate_greedy

pytestmark = pytest.mark.slow

NAMES = list(FAMILIES)
SCENARIOS = {
    "one-token-chunks": DriverConfig(chunk_size=1, shuffle_seed=3),
    "whole-prompts": DriverConfig(chunk_size=64, mixed=False),
    "refill": DriverConfig(chunk_size=7, mixed=False),
    "async": DriverConfig(chunk_size=6, async_plans=True),
    "swap-each": DriverConfig(chunk_size=4, swap_after={"r0": 1, "r1": 9, "r2": 3}),
    "recompute-each": DriverConfig(chunk_size=3, recompute_after={"r0": 2, "r1": 1, "r2": 12}),
    "async-swap-recompute": DriverConfig(
        chunk_size=5, async_plans=True, swap_after={"r1": 2}, recompute_after={"r0": 5}
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", NAMES)
def test_every_plan_shape_gives_transformers_ids(
    written: WrittenFamilies, name: str, scenario: str
) -> None:
    checkpoint = written[name]
    got = kvgate_greedy(
        checkpoint.model_dir,
        checkpoint.prompts,
        SCENARIOS[scenario],
        host_snapshot_blocks=SNAPSHOT_BLOCKS,
    )
    assert got == checkpoint.greedy_ids


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_process(written: WrittenFamilies, name: str, tmp_path: Path) -> None:
    """Heads, MLP columns and vocabulary split over two gloo ranks (Phi-3's fused projections
    cut into each rank's q/k/v and gate/up rows, OLMo 2's whole-projection QK-norm summed across
    ranks): the tensor-parallel test's scenarios give the one-process outputs."""
    from tests.executor.test_tensor_parallel import _run_ranks
    from tests.executor.tp_scenarios import SCENARIOS as TP_SCENARIOS
    from tests.executor.tp_scenarios import tp_requests

    model_dir = written[name].model_dir
    out = tmp_path / "outputs.json"
    assert _run_ranks("equality", out, [model_dir]) == [0, 0]
    got = json.loads(out.read_text())[model_dir.name]
    loaded = load_model(model_dir)
    for scenario, cfg in TP_SCENARIOS.items():
        executor = Executor(loaded, num_blocks=400, block_size=4, host_snapshot_blocks=200)
        expected = Driver(
            executor, tp_requests(loaded.model, executor.info.structured_outputs), cfg
        ).run()
        assert got[scenario] == {
            rid: [tokens, depths] for rid, (tokens, depths) in expected.items()
        }, scenario


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariant_mode_gives_a_request_its_bits_in_any_batch(
    written: WrittenFamilies, name: str
) -> None:
    if not prepare_cpu_kernels().compiled:
        pytest.skip("kvgate's CPU kernels do not compile here (the mode needs them)")
    checkpoint = written[name]
    loaded = load_model(checkpoint.model_dir, batch_invariant=True)
    assert_batch_invariant(loaded, checkpoint.prompts)
