"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE) written by transformers 5, served
by kvgate's executor: transformers' own greedy ids and log-probabilities.

Five tiny checkpoints, their weights re-drawn wide (the routers too, so the prompts reach nearly
every expert): Mixtral (8 experts, top-2, always renormalised); Mixtral with a sliding window
shorter than the prompts; Qwen3-MoE without renormalisation and with one dense layer among the
sparse ones (``mlp_only_layers``); Qwen3-MoE with ``norm_topk_prob`` and top-3 of 6; Qwen2-MoE
with its sigmoid-gated shared expert and q/k/v biases. Each gives transformers' greedy ids
through the real executor (batched, chunked, one request swapped out and one recomputed), from
either config layout, with every top log-probability within tolerance; the two-rank tensor-
parallel executor (gloo) matches one process; the batch-invariant mode keeps a request's bits
in any batch. A checkpoint with two experts swapped, a config with the renormalisation flipped,
or the window dropped gives other ids: the comparisons can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.executor.config import CheckpointError, load_config, parse_config
from kvgate.executor.executor import Executor
from kvgate.executor.layer_ops import prepare_cpu_kernels
from kvgate.executor.loader import load_model
from kvgate.executor.reference import reference_logits
from kvgate.protocol.enums import DType
from tests.executor.driver import Driver
from tests.executor.family_cases import WINDOW, Family
from tests.executor.family_checks import (
    CORE,
    SNAPSHOT_BLOCKS,
    assert_batch_invariant,
    assert_core,
    assert_logprobs_close,
    assert_old_layout,
)
from tests.executor.hf_checkpoints import (
    SHAPE,
    Written,
    config_of,
    copy_with_config,
    kvgate_greedy,
)

# float32 logits: kvgate's oneDNN linears and compiled norms sum in other orders than
# transformers' eager forward. Measured: at most 2e-5 apart on logits of magnitude up to 8.
_LOGITS_TOLERANCE = {"atol": 1e-4, "rtol": 1e-5}


# Weights and routers re-drawn wide (hf_checkpoints.write): the prompts reach nearly every expert.
MOE_FAMILIES: dict[str, Family] = {
    "mixtral": Family("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # Every Mixtral layer slides when sliding_window is set (as Mistral's).
    "mixtral-window": Family(
        "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}
    ),
    # One dense layer among the sparse ones; the top-2 weights not renormalised.
    "qwen3_moe": Family(
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe-norm": Family(
        "qwen3_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # The sigmoid-gated shared expert; q, k and v biased.
    "qwen2_moe": Family(
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
}
_CASES = list(MOE_FAMILIES)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    return {name: MOE_FAMILIES[name].write(name, tmp_path_factory.mktemp(name)) for name in _CASES}


@pytest.mark.parametrize("case", _CASES)
def test_the_prompts_reach_most_experts(written: dict[str, Written], case: str) -> None:
    """Each sparse layer routes the prompts and their continuations to all experts but at most
    one (a test whose tokens all meet one expert would miss most of the weights)."""
    checkpoint = written[case]
    moe = load_config(checkpoint.model_dir).moe
    assert moe is not None
    used: dict[int, set[int]] = {}  # sparse layer -> experts chosen
    for prompt, ids in zip(checkpoint.prompts, checkpoint.greedy_ids, strict=True):
        with torch.no_grad():
            out = checkpoint.model(torch.tensor([prompt + ids]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            used.setdefault(layer, set()).update(logits.topk(moe.top_k).indices.flatten().tolist())
    assert len(used) == sum(moe.sparse_layers)
    for experts in used.values():
        assert len(experts) >= moe.num_experts - 1, experts


@pytest.mark.parametrize("case", _CASES)
def test_greedy_ids_equal_transformers(written: dict[str, Written], case: str) -> None:
    assert_core(written[case])


@pytest.mark.parametrize("case", _CASES)
def test_the_transformers_4_layout_gives_the_same_ids(
    written: dict[str, Written], case: str, tmp_path: Path
) -> None:
    assert_old_layout(written[case], tmp_path)


@pytest.mark.parametrize("case", _CASES)
def test_logprobs_within_tolerance(written: dict[str, Written], case: str) -> None:
    assert_logprobs_close(written[case], written[case].model_dir)


@pytest.mark.parametrize("case", _CASES)
def test_logits_match_transformers(written: dict[str, Written], case: str) -> None:
    """Every logit, not only the top ones: the unpaged reference (prefill, then one decode step
    per greedy token) against transformers' forward over the same sequence."""
    checkpoint = written[case]
    loaded = load_model(checkpoint.model_dir)
    for prompt, ids in zip(checkpoint.prompts, checkpoint.greedy_ids, strict=True):
        ours = reference_logits(loaded.model, prompt + ids, len(prompt))
        with torch.no_grad():
            theirs = checkpoint.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(ours, theirs.float(), **_LOGITS_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CASES)
def test_cuda_gives_transformers_greedy_ids(written: dict[str, Written], case: str) -> None:
    """On a GPU the experts run the Triton kernel (float32: IEEE products, not tf32)."""
    checkpoint = written[case]
    loaded = load_model(checkpoint.model_dir, device="cuda", dtype=DType.FLOAT32)
    got = kvgate_greedy(loaded, checkpoint.prompts, CORE, host_snapshot_blocks=SNAPSHOT_BLOCKS)
    assert got == checkpoint.greedy_ids


# ------------------------------------------------------------------ the comparisons can fail


def test_two_swapped_experts_change_the_ids(written: dict[str, Written], tmp_path: Path) -> None:
    checkpoint = written["mixtral"]
    target = copy_with_config(
        checkpoint.model_dir, tmp_path / "swapped", config_of(checkpoint.model_dir)
    )
    tensors = load_file(str(target / "model.safetensors"))
    for layer in range(SHAPE["num_hidden_layers"]):
        for w in ("w1", "w2", "w3"):
            first = f"model.layers.{layer}.block_sparse_moe.experts.0.{w}.weight"
            second = f"model.layers.{layer}.block_sparse_moe.experts.1.{w}.weight"
            tensors[first], tensors[second] = tensors[second], tensors[first]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    ids = kvgate_greedy(target, checkpoint.prompts)
    assert all(w != t for w, t in zip(ids, checkpoint.greedy_ids, strict=True))


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe-norm"])
def test_flipped_renormalisation_changes_the_ids(
    written: dict[str, Written], case: str, tmp_path: Path
) -> None:
    checkpoint = written[case]
    config = config_of(checkpoint.model_dir)
    config["norm_topk_prob"] = not config["norm_topk_prob"]
    flipped = copy_with_config(checkpoint.model_dir, tmp_path / "flipped", config)
    ids = kvgate_greedy(flipped, checkpoint.prompts)
    assert any(w != t for w, t in zip(ids, checkpoint.greedy_ids, strict=True))


def test_the_window_binds(written: dict[str, Written], tmp_path: Path) -> None:
    """Served without its window, the windowed Mixtral gives other ids: the prompts and the
    generation cross the window's edge."""
    checkpoint = written["mixtral-window"]
    config = config_of(checkpoint.model_dir) | {"sliding_window": None}
    unwindowed = copy_with_config(checkpoint.model_dir, tmp_path / "full", config)
    ids = kvgate_greedy(unwindowed, checkpoint.prompts)
    assert any(w != t for w, t in zip(ids, checkpoint.greedy_ids, strict=True))


# ------------------------------------------------------------------------- tensor parallel


def test_two_ranks_match_one_process(written: dict[str, Written], tmp_path: Path) -> None:
    """Every expert's columns split over two gloo ranks (and the shared expert's), the router
    replicated: the tensor-parallel test's scenarios give the one-process outputs."""
    from tests.executor.test_tensor_parallel import _run_ranks
    from tests.executor.tp_scenarios import SCENARIOS, tp_requests

    dirs = [written[case].model_dir for case in ("mixtral", "qwen3_moe-norm", "qwen2_moe")]
    out = tmp_path / "outputs.json"
    assert _run_ranks("equality", out, dirs) == [0, 0]
    got = json.loads(out.read_text())
    for model_dir in dirs:
        loaded = load_model(model_dir)
        for scenario, cfg in SCENARIOS.items():
            executor = Executor(loaded, num_blocks=400, block_size=4, host_snapshot_blocks=200)
            expected = Driver(
                executor, tp_requests(loaded.model, executor.info.structured_outputs), cfg
            ).run()
            assert got[model_dir.name][scenario] == {
                rid: [tokens, depths] for rid, (tokens, depths) in expected.items()
            }, (model_dir.name, scenario)


# -------------------------------------------------------------------------- batch-invariant


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-norm", "qwen2_moe"])
def test_batch_invariant_mode_gives_a_request_its_bits_in_any_batch(
    written: dict[str, Written], case: str
) -> None:
    """The experts' packed linears give a row its bits whatever rows share its expert, the k
    slots are summed in order, the shared expert's gate takes the invariant sigmoid (with the
    experts on F.linear, or torch.sigmoid for the gate, this fails)."""
    if not prepare_cpu_kernels().compiled:
        pytest.skip("kvgate's CPU kernels do not compile here (the mode needs them)")
    checkpoint = written[case]
    assert_batch_invariant(
        load_model(checkpoint.model_dir, batch_invariant=True), checkpoint.prompts
    )


# ------------------------------------------------------------------------------ config keys


@pytest.mark.parametrize("case", _CASES)
def test_every_key_transformers_writes_is_in_a_table(case: str) -> None:
    """The whole dictionary of the installed transformers' config (not only the saved keys):
    an upgrade that adds a key fails here first."""
    config = MOE_FAMILIES[case].config()
    parsed = parse_config(config.to_dict())
    assert parsed.moe is not None
    assert parsed.moe.num_experts == config.num_experts  # transformers' alias, either name
    assert parsed.moe.top_k == config.num_experts_per_tok


def test_qwen2_moe_knows_num_experts_only() -> None:
    raw = MOE_FAMILIES["qwen2_moe"].config().to_dict() | {"num_local_experts": 4}
    with pytest.raises(CheckpointError, match="unknown config key num_local_experts=4"):
        parse_config(raw)
