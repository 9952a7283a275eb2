"""The fused-experts Triton kernel (interpreted on CPU) against its plain-torch specification.

The specification itself is first checked against the formula written per token (a loop over
every token's k experts, no grouping), so a grouping mistake in the reference cannot hide; then
the kernel is compared with it for float32 and float16, several expert counts and top-k, 1 to
200 tokens, odd hidden and intermediate sizes that cross the 16-wide interpreter tiles, and
routings that leave experts without a token. The block plan is checked as data.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvgate.kernels import triton_moe
from kvgate.kernels.torch_moe import fused_experts_reference

# (fp32, fp16): float32 accumulates in another order; float16 also rounds the activation once
# in the kernel where the reference rounds gate, up and their product separately.
_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-2, 2e-2)}
_TIGHT = {"atol": 2e-5, "rtol": 2e-5}


def _case(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype,
    *,
    hidden: int = 40,
    inter: int = 24,
    only_experts: list[int] | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Inputs whose routing draws k distinct experts per token, from ``only_experts`` if given."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    gate_up = (0.3 * torch.randn(num_experts, 2 * inter, hidden, generator=generator)).to(dtype)
    down = (0.3 * torch.randn(num_experts, hidden, inter, generator=generator)).to(dtype)
    allowed = torch.tensor(only_experts if only_experts is not None else range(num_experts))
    scores = torch.rand(num_tokens, len(allowed), generator=generator)
    topk_weights, slots = scores.topk(top_k, dim=-1)
    return x, gate_up, down, topk_weights, allowed[slots]


def _per_token(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The formula one token and one slot at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            w_gate, w_up = gate_up[e, :inter].double(), gate_up[e, inter:].double()
            act = F.silu(w_gate @ x[t].double()) * (w_up @ x[t].double())
            out[t] += float(topk_weights[t, j]) * (down[e].double() @ act)
    return out


@pytest.mark.parametrize(("num_experts", "top_k"), [(1, 1), (4, 2), (8, 2), (6, 3)])
def test_the_reference_is_the_per_token_formula(num_experts: int, top_k: int) -> None:
    args = _case(23, num_experts, top_k, torch.float32)
    expected = _per_token(*args)
    # float32 products against float64 ones
    torch.testing.assert_close(fused_experts_reference(*args).double(), expected, **_TIGHT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"),
    [(1, 4, 2), (5, 8, 2), (37, 4, 1), (64, 6, 3), (200, 8, 2)],
)
def test_kernel_matches_reference(
    interpreted_triton: None, num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype
) -> None:
    args = _case(num_tokens, num_experts, top_k, dtype, seed=num_tokens)
    atol, rtol = _TOLERANCE[dtype]
    torch.testing.assert_close(
        triton_moe.fused_experts_triton(*args),
        fused_experts_reference(*args),
        atol=atol,
        rtol=rtol,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_experts_without_tokens_and_odd_sizes(interpreted_triton: None, dtype: torch.dtype) -> None:
    # 8 experts, tokens routed to 0, 3 and 6 only: five experts get no block at all. Hidden 33
    # and intermediate 17 leave a partial tile on every edge.
    args = _case(19, 8, 2, dtype, hidden=33, inter=17, only_experts=[0, 3, 6])
    atol, rtol = _TOLERANCE[dtype]
    blocks = triton_moe.plan_expert_blocks(args[4], 8, 16)
    assert set(blocks.block_experts.tolist()) <= {0, 3, 6, 8}
    torch.testing.assert_close(
        triton_moe.fused_experts_triton(*args),
        fused_experts_reference(*args),
        atol=atol,
        rtol=rtol,
    )


def test_no_tokens_give_an_empty_output(interpreted_triton: None) -> None:
    x, gate_up, down, weights, ids = _case(0, 4, 2, torch.float32)
    assert triton_moe.fused_experts_triton(x, gate_up, down, weights, ids).shape == (0, 40)


def test_the_plan_sorts_pairs_into_padded_runs() -> None:
    ids = torch.tensor([[0, 3], [3, 1], [0, 3]])  # pairs 0..5 = (t0,j0), (t0,j1), (t1,j0), ...
    blocks = triton_moe.plan_expert_blocks(ids, num_experts=5, block_m=4)
    pad = 6
    # expert 0: pairs 0, 4; expert 1: pair 3; expert 3: pairs 1, 2, 5; experts 2 and 4: none
    runs = blocks.pair_ids.view(-1, 4).tolist()
    assert runs[:3] == [[0, 4, pad, pad], [3, pad, pad, pad], [1, 2, 5, pad]]
    assert all(run == [pad] * 4 for run in runs[3:])
    assert blocks.block_experts.tolist()[:3] == [0, 1, 3]
    assert all(e == 5 for e in blocks.block_experts.tolist()[3:])  # blocks with no work


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_holds_every_pair_once(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_tokens, num_experts, top_k, block_m = 57, 9, 3, 16
    ids = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices
    blocks = triton_moe.plan_expert_blocks(ids, num_experts, block_m)
    pair_ids = blocks.pair_ids.view(-1, block_m)
    real = pair_ids[pair_ids < num_tokens * top_k]
    assert sorted(real.tolist()) == list(range(num_tokens * top_k))
    flat = ids.reshape(-1)
    for run, expert in zip(pair_ids, blocks.block_experts.tolist(), strict=True):
        pairs = run[run < num_tokens * top_k]
        if expert == num_experts:
            assert pairs.numel() == 0
        else:
            assert bool((flat[pairs.long()] == expert).all())


# (id, change to the arguments, exception type, message fragment)
_BAD_ARGS = [
    ("x-1d", lambda a: {"x": a["x"][0]}, ValueError, "x must be [n, H]"),
    ("x-int", lambda a: {"x": a["x"].to(torch.int32)}, TypeError, "x must be float32"),
    ("down-dtype", lambda a: {"down": a["down"].half()}, TypeError, "down must have x's dtype"),
    ("hidden", lambda a: {"x": a["x"][:, :30]}, ValueError, "x has hidden size 30"),
    (
        "down-shape",
        lambda a: {"down": a["down"][:, :, :20]},
        ValueError,
        "down must be [4, 40, 24]",
    ),
    (
        "weights-fp16",
        lambda a: {"topk_weights": a["topk_weights"].half()},
        TypeError,
        "topk_weights must be float32",
    ),
    (
        "ids-float",
        lambda a: {"topk_ids": a["topk_ids"].float()},
        TypeError,
        "topk_ids must be int32 or int64",
    ),
    (
        "ids-rows",
        lambda a: {"topk_ids": a["topk_ids"][:3], "topk_weights": a["topk_weights"][:3]},
        ValueError,
        "with n = 6",
    ),
    (
        "ids-range",
        lambda a: {"topk_ids": a["topk_ids"] + 3},
        ValueError,
        "topk_ids must lie in [0, 4)",
    ),
    (
        "top-k",
        lambda a: {
            "topk_ids": torch.zeros(6, 5, dtype=torch.int64),
            "topk_weights": torch.ones(6, 5),
        },
        ValueError,
        "top-k 5 exceeds the 4 experts",
    ),
]


@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [case[1:] for case in _BAD_ARGS],
    ids=[case[0] for case in _BAD_ARGS],
)
@pytest.mark.parametrize("launcher", ["triton-interpreted", "reference"])
def test_bad_arguments_are_named(
    request: pytest.FixtureRequest,
    launcher: str,
    change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    error: type[Exception],
    fragment: str,
) -> None:
    if launcher == "triton-interpreted":
        request.getfixturevalue("interpreted_triton")
        run = triton_moe.fused_experts_triton
    else:
        run = fused_experts_reference
    x, gate_up, down, weights, ids = _case(6, 4, 2, torch.float32)
    args = {"x": x, "gate_up": gate_up, "down": down, "topk_weights": weights, "topk_ids": ids}
    with pytest.raises(error) as caught:
        run(**(args | change(args)))
    assert fragment in str(caught.value)


# ---------------------------------------------------------------------------- compiled, GPU

# Against the float32 specification on the CPU. bfloat16 keeps 8 mantissa bits: the activation
# stored between the GEMMs and the output each cost up to 2**-9 relative. float32 runs IEEE
# (not tf32) products.
_GPU_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_triton")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [
        (1, 64, 8, 1024, 768),  # decode, fine-grained experts (Qwen3-MoE-like)
        (16, 64, 8, 1024, 768),
        (300, 64, 8, 1024, 768),  # 37 pairs per expert: 32-row blocks
        (1, 8, 2, 512, 1408),  # Mixtral-like
        (1024, 8, 2, 512, 1408),  # 256 pairs per expert: 64-row blocks
        (7, 128, 8, 256, 96),  # most experts without a token
    ],
)
def test_compiled_kernel_matches_reference(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(num_tokens + num_experts)
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=generator) * inter**-0.5
    weights, ids = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    cuda = [t.to("cuda") for t in (x.to(dtype), gate_up.to(dtype), down.to(dtype))]
    out = triton_moe.fused_experts_triton(*cuda, weights.cuda(), ids.cuda())
    expected = fused_experts_reference(
        x.to(dtype).float(), gate_up.to(dtype).float(), down.to(dtype).float(), weights, ids
    )
    atol, rtol = _GPU_TOLERANCE[dtype]
    assert out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


def test_the_executor_block_runs_the_kernel(
    interpreted_triton: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernels' dispatch picks Triton (CUDA; here the interpreter), the executor's MoE
    block runs this kernel, and gives the specification's output."""
    from kvgate.executor.layer_ops import TorchLayerOps
    from kvgate.executor.linear import LinearBackend
    from kvgate.executor.moe import MoeBlock, MoeWeights
    from kvgate.executor.moe_config import ExpertNaming, MoeConfig

    calls = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return launcher(*args)

    launcher = triton_moe.fused_experts_triton
    monkeypatch.setattr(triton_moe, "fused_experts_triton", counted)
    x, gate_up, down, _, _ = _case(9, 4, 2, torch.float32)
    router = torch.randn(4, x.shape[1], generator=torch.Generator().manual_seed(1))
    config = MoeConfig(
        num_experts=4,
        top_k=2,
        normalize_top_k=True,
        expert_intermediate_size=down.shape[2],
        sparse_layers=(True,),
        naming=ExpertNaming.MIXTRAL,
    )
    block = MoeBlock(
        config, MoeWeights(router, gate_up, down, None), LinearBackend.TORCH, TorchLayerOps()
    )
    out = block(x)
    assert calls == [9]
    weights, ids = (x @ router.T).softmax(-1).topk(2, dim=-1)
    expected = fused_experts_reference(
        x, gate_up, down, weights / weights.sum(-1, keepdim=True), ids
    )
    torch.testing.assert_close(out, expected, **_TIGHT)
