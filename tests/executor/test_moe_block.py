"""The MoE block against transformers' own sparse blocks, and the routing and config rules.

transformers 5.24's ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` (with and without
``norm_topk_prob``) and ``Qwen2MoeSparseMoeBlock`` (shared expert) are built with wide random
weights and run on the same input as kvgate's :class:`MoeBlock`, on both CPU paths (oneDNN
packed linears, and the torch specification). Each rule the block implements is also shown to
matter: the renormalisation flipped or two experts swapped, the block no longer matches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from kvgate.executor.config import CheckpointError
from kvgate.executor.layer_ops import TorchLayerOps
from kvgate.executor.linear import LinearBackend
from kvgate.executor.moe import (
    MoeBlock,
    MoeWeights,
    SharedExpertWeights,
    invariant_sigmoid,
    route,
)
from kvgate.executor.moe_config import ExpertNaming, MoeConfig, read_moe

HIDDEN, INTER, SHARED_INTER, EXPERTS, TOP_K = 32, 24, 40, 6, 2
_CLOSE = {"atol": 1e-5, "rtol": 1e-5}


@dataclass(frozen=True)
class _Case:
    name: str
    normalize: bool
    shared: bool


_CASES = [
    _Case("mixtral", normalize=True, shared=False),
    _Case("qwen3_moe", normalize=False, shared=False),
    _Case("qwen3_moe-norm", normalize=True, shared=False),
    _Case("qwen2_moe", normalize=False, shared=True),
]


def _transformers_block(case: _Case) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    shape = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K}
    block: Any
    if case.name == "mixtral":
        config = MixtralConfig(**shape, intermediate_size=INTER, num_local_experts=EXPERTS)
        block = MixtralSparseMoeBlock(config)
    elif case.name.startswith("qwen3_moe"):
        config = Qwen3MoeConfig(
            **shape,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            norm_topk_prob=case.normalize,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        config = Qwen2MoeConfig(
            **shape,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            shared_expert_intermediate_size=SHARED_INTER,
        )
        block = Qwen2MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(len(case.name))
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return block.eval()


def _weights(block: Any) -> MoeWeights:
    """kvgate's stacked weights from the block's (transformers 5 keeps experts stacked too)."""
    state = block.state_dict()
    shared = None
    if "shared_expert_gate.weight" in state:
        shared = SharedExpertWeights(
            gate_up=torch.cat(
                [state["shared_expert.gate_proj.weight"], state["shared_expert.up_proj.weight"]]
            ),
            down=state["shared_expert.down_proj.weight"],
            gate=state["shared_expert_gate.weight"],
        )
    return MoeWeights(
        state["gate.weight"], state["experts.gate_up_proj"], state["experts.down_proj"], shared
    )


def _config(case: _Case) -> MoeConfig:
    return MoeConfig(
        num_experts=EXPERTS,
        top_k=TOP_K,
        normalize_top_k=case.normalize,
        expert_intermediate_size=INTER,
        sparse_layers=(True,),
        shared_expert_intermediate_size=SHARED_INTER if case.shared else None,
        naming=ExpertNaming.MIXTRAL if case.name == "mixtral" else ExpertNaming.QWEN,
    )


def _input(num_tokens: int = 13) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7))


def _theirs(block: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = block(x.unsqueeze(0))[0]
    return out


@pytest.mark.parametrize("backend", list(LinearBackend))
@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_block_matches_transformers(case: _Case, backend: LinearBackend) -> None:
    block = _transformers_block(case)
    x = _input()
    ours = MoeBlock(_config(case), _weights(block), backend, TorchLayerOps())(x)
    torch.testing.assert_close(ours, _theirs(block, x), **_CLOSE)


def test_the_routing_uses_several_experts() -> None:
    """The inputs above spread over the experts (a test routed to one expert sees little)."""
    block = _transformers_block(_CASES[0])
    _, ids = route(_input() @ block.state_dict()["gate.weight"].T, TOP_K, normalize=True)
    assert len(set(ids.flatten().tolist())) >= EXPERTS - 1


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_flipped_renormalisation_is_seen(case: _Case) -> None:
    block = _transformers_block(case)
    x = _input()
    wrong = _config(case).model_copy(update={"normalize_top_k": not case.normalize})
    ours = MoeBlock(wrong, _weights(block), LinearBackend.ONEDNN, TorchLayerOps())(x)
    assert not torch.allclose(ours, _theirs(block, x), **_CLOSE)


def test_a_swapped_expert_is_seen() -> None:
    block = _transformers_block(_CASES[0])
    weights = _weights(block)
    order = [1, 0, *range(2, EXPERTS)]
    swapped = replace(weights, gate_up=weights.gate_up[order], down=weights.down[order])
    x = _input()
    ours = MoeBlock(_config(_CASES[0]), swapped, LinearBackend.ONEDNN, TorchLayerOps())(x)
    assert not torch.allclose(ours, _theirs(block, x), **_CLOSE)


def test_batch_invariant_block_gives_a_row_its_bits_in_any_batch() -> None:
    case = _CASES[3]  # shared expert too
    block = MoeBlock(
        _config(case),
        _weights(_transformers_block(case)),
        LinearBackend.ONEDNN,
        TorchLayerOps(),
        batch_invariant=True,
    )
    x = _input(40)
    batch = block(x)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 22), slice(39, 40)):
        assert torch.equal(block(x[rows]), batch[rows]), rows


def test_batch_invariant_block_needs_packed_linears() -> None:
    case = _CASES[0]
    with pytest.raises(ValueError, match="oneDNN"):
        MoeBlock(
            _config(case),
            _weights(_transformers_block(case)),
            LinearBackend.TORCH,
            TorchLayerOps(),
            batch_invariant=True,
        )


def test_shards_sum_to_the_whole_block() -> None:
    """Tensor parallel: each rank's experts keep their share of the intermediate columns (and
    of the shared expert's); the ranks' outputs, summed (the all-reduce), are the block's."""
    case = _CASES[3]
    block = _transformers_block(case)
    weights, config = _weights(block), _config(case)
    x = _input()
    world = 2
    total = torch.zeros_like(x)
    for rank in range(world):
        total += MoeBlock(
            config.sharded(world),
            _shard(weights, rank, world),
            LinearBackend.ONEDNN,
            TorchLayerOps(),
        )(x)
    torch.testing.assert_close(total, _theirs(block, x), **_CLOSE)


def _shard(weights: MoeWeights, rank: int, world: int) -> MoeWeights:
    def columns(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 I, H] -> this rank's gate, up
        gate, up = gate_up.chunk(2, dim=-2)
        part = gate.shape[-2] // world
        rows = slice(rank * part, (rank + 1) * part)
        return torch.cat([gate[..., rows, :], up[..., rows, :]], dim=-2)

    def inputs(down: torch.Tensor) -> torch.Tensor:  # [..., H, I] -> this rank's columns
        part = down.shape[-1] // world
        return down[..., rank * part : (rank + 1) * part]

    shared = weights.shared
    assert shared is not None
    return MoeWeights(
        weights.router,
        columns(weights.gate_up),
        inputs(weights.down),
        SharedExpertWeights(columns(shared.gate_up), inputs(shared.down), shared.gate),
    )


def test_invariant_sigmoid_gives_an_element_its_bits_anywhere() -> None:
    """torch.sigmoid computes a tensor's last elements in a scalar loop, 1 ulp apart for some
    inputs; the shared expert's gate in the batch-invariant mode must not."""
    generator = torch.Generator().manual_seed(3)
    for size in (1, 2, 7, 8, 9, 16, 17, 31, 33, 64, 100):
        x = 4 * torch.randn(size, 1, generator=generator)
        whole = invariant_sigmoid(x)
        for i in range(size):
            assert torch.equal(invariant_sigmoid(x[i : i + 1]), whole[i : i + 1]), (size, i)
            assert torch.equal(invariant_sigmoid(x[i:]), whole[i:]), (size, i)
    x = torch.cat([40 * torch.randn(10_000, generator=generator), torch.tensor([0.0, 87.0])])
    torch.testing.assert_close(invariant_sigmoid(x), torch.sigmoid(x), atol=2e-7, rtol=3e-7)
    extremes = invariant_sigmoid(torch.tensor([-1e4, -100.0, 100.0, 1e4, float("inf")]))
    torch.testing.assert_close(extremes, torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))


# --------------------------------------------------------------------------------- routing


def test_route_softmax_top_k_and_renormalisation() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -0.5, 0.7, -1.0]])
    weights, ids = route(logits, 2, normalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2], [2, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normalized, same_ids = route(logits, 2, normalize=True)
    assert torch.equal(same_ids, ids)
    # renormalised top-k probabilities are a softmax over the chosen logits
    torch.testing.assert_close(normalized, logits.gather(1, ids).softmax(-1))
    assert normalized.dtype == torch.float32


def test_route_runs_in_float32_for_half_logits() -> None:
    logits = torch.tensor([[10.0, 10.001, 9.0]], dtype=torch.float16)
    weights, _ = route(logits, 1, normalize=False)
    assert weights.dtype == torch.float32


# ---------------------------------------------------------------------------------- config


def _qwen3_moe_raw(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    } | changes


@pytest.mark.parametrize(
    ("mlp_only_layers", "decoder_sparse_step"), [([], 1), ([1], 1), ([], 2), ([0, 3], 3)]
)
def test_sparse_layers_follow_transformers(
    mlp_only_layers: list[int], decoder_sparse_step: int
) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeModel
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    settings = {"mlp_only_layers": mlp_only_layers, "decoder_sparse_step": decoder_sparse_step}
    model = Qwen3MoeModel(
        Qwen3MoeConfig(
            vocab_size=16,
            hidden_size=16,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_hidden_layers=5,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            **settings,
        )
    )
    theirs = tuple(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.layers)
    moe = read_moe(_qwen3_moe_raw(**settings), "qwen3_moe", 5)
    assert moe is not None and moe.sparse_layers == theirs


def test_expert_count_under_either_name() -> None:
    by_alias = {k: v for k, v in _qwen3_moe_raw().items() if k != "num_experts"}
    moe = read_moe(by_alias | {"num_local_experts": 8}, "qwen3_moe", 2)
    assert moe is not None and moe.num_experts == 8
    mixtral = {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16}
    moe = read_moe(mixtral, "mixtral", 2)
    assert moe is not None and moe.num_experts == 4 and moe.normalize_top_k


@pytest.mark.parametrize(
    ("raw", "model_type", "fragment"),
    [
        (_qwen3_moe_raw(num_local_experts=4), "qwen3_moe", "num_experts=8 but num_local_experts=4"),
        (_qwen3_moe_raw(num_experts=None), "qwen3_moe", "lacks num_experts"),
        (_qwen3_moe_raw(moe_intermediate_size=None), "qwen3_moe", "lacks moe_intermediate_size"),
        (_qwen3_moe_raw(), "qwen2_moe", "lacks shared_expert_intermediate_size"),
        (_qwen3_moe_raw(num_experts_per_tok=9), "qwen3_moe", "num_experts_per_tok 9 exceeds"),
        (_qwen3_moe_raw(decoder_sparse_step=0), "qwen3_moe", "decoder_sparse_step must be"),
        (_qwen3_moe_raw(mlp_only_layers="1"), "qwen3_moe", "mlp_only_layers must be"),
        (_qwen3_moe_raw(num_experts=0), "qwen3_moe", "num_experts must be a positive"),
        (_qwen3_moe_raw(use_sliding_window=True), "qwen3_moe", "use_sliding_window=true"),
        (
            _qwen3_moe_raw(use_sliding_window=True, shared_expert_intermediate_size=8),
            "qwen2_moe",
            "use_sliding_window=true",
        ),
        # Qwen2MoeConfig has no alias: transformers would ignore num_local_experts
        (
            {"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
            | {"shared_expert_intermediate_size": 8},
            "qwen2_moe",
            "lacks num_experts",
        ),
    ],
)
def test_bad_expert_settings_are_named(raw: dict[str, Any], model_type: str, fragment: str) -> None:
    with pytest.raises(CheckpointError, match=fragment):
        read_moe(raw, model_type, 4)


def test_dense_types_have_no_experts() -> None:
    assert read_moe({"num_experts": 8}, "llama", 2) is None


def test_shards_must_divide_the_expert_width() -> None:
    moe = read_moe(_qwen3_moe_raw(moe_intermediate_size=30), "qwen3_moe", 2)
    assert moe is not None
    assert moe.shard_refusal(2) is None
    assert moe.shard_refusal(4) == (
        "the experts' intermediate size 30 is not divisible by --tensor-parallel-size 4"
    )
    assert moe.sharded(2).expert_intermediate_size == 15
