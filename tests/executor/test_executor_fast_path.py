"""The CPU fast path against the plain torch reference it replaces.

Fast path: linears on oneDNN-prepacked weights (fused q/k/v and gate/up), one RoPE over the
adjacent q and k heads with cos/sin gathered once per pass, KV writes planned once per step, and,
where they build, the compiled CPU kernels (norms, SiLU-and-mul, RoPE, KV writes, decode
attention: ``kvgate.kernels.cpu``). Reference: ``F.linear`` on the checkpoint weights and the
torch expressions (``TorchLayerOps``), textbook rotate-half, unplanned writes. The GEMMs and
norms sum in another order, so hidden states agree to rounding (checked with a tolerance) and
greedy tokens exactly; the RoPE and KV-write changes are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate import kernels
from kvgate.executor.config import RopeScaling
from kvgate.executor.executor import Executor
from kvgate.executor.layer_ops import TorchLayerOps, prepare_cpu_kernels
from kvgate.executor.linear import Linear, LinearBackend, select_linear_backend
from kvgate.executor.loader import LoadedModel
from kvgate.executor.model import LayerAttention, Model
from kvgate.executor.rope import RotaryTable
from kvgate.protocol import step as wire
from kvgate.protocol.enums import ExitPolicy
from tests.executor.driver import Driver, DriverConfig
from tests.executor.workloads import reference_outputs
from tests.kernels.reference import write_kv_reference

pytestmark = pytest.mark.skipif(
    select_linear_backend(torch.device("cpu"), torch.float32) is not LinearBackend.ONEDNN,
    reason="this torch build has no oneDNN",
)


def _plain(loaded: LoadedModel) -> LoadedModel:
    """The same weights behind the plain torch linears and layer operations."""
    model = Model(
        loaded.model.config, loaded.model.weights, LinearBackend.TORCH, layer_ops=TorchLayerOps()
    )
    return LoadedModel(model, loaded.tokenizer, loaded.source)


def test_cpu_float32_models_take_the_fast_path(family_model: LoadedModel) -> None:
    assert family_model.model.linear_backend is LinearBackend.ONEDNN
    assert select_linear_backend(torch.device("cpu"), torch.bfloat16) is LinearBackend.TORCH
    assert select_linear_backend(torch.device("cuda"), torch.float32) is LinearBackend.TORCH
    # The compiled layer operations wherever this machine builds them.
    assert family_model.model.ops.compiled is prepare_cpu_kernels().compiled


@pytest.mark.parametrize("rows", [1, 7, 32, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(rows, 40, generator=generator)
    fast = Linear.build(weight, b, LinearBackend.ONEDNN)
    assert fast.packed is not None
    torch.testing.assert_close(fast(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    # A row's result does not depend on the rows batched with it.
    assert torch.equal(fast(x[:1]), fast(x)[:1])


def test_model_forward_matches_the_plain_reference(family_model: LoadedModel) -> None:
    fast, plain = family_model.model, _plain(family_model).model
    tokens = torch.arange(19) % fast.config.vocab_size
    positions = torch.arange(19)

    def forward(model: Model) -> torch.Tensor:
        def attention(
            layer: int, settings: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=settings.softmax_scale, enable_gqa=True,
            )  # fmt: skip
            return out.transpose(0, 1)

        with torch.inference_mode():
            hidden = model.core_pass(model.embed(tokens), positions, 18, attention)
            return model.logits(hidden)

    fast_logits, plain_logits = forward(fast), forward(plain)
    torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_logits.argmax(-1), plain_logits.argmax(-1))


def _greedy_requests(loaded: LoadedModel) -> list[tuple[wire.NewRequest, int]]:
    vocab = loaded.model.config.vocab_size
    return [
        (
            wire.NewRequest(
                request_id=f"g{i}",
                prompt_token_ids=[(13 * i + 5 * j) % vocab for j in range(length)],
                sampling=wire.SamplingParams(max_tokens=12, ignore_eos=True),
            ),
            1 + i % 3,
        )
        for i, length in enumerate([1, 4, 9, 17, 26])
    ]


def test_paged_fast_path_generates_what_the_plain_reference_does(
    family_model: LoadedModel,
) -> None:
    requests = _greedy_requests(family_model)
    # FIXED: every token runs every loop, so no exit decision sits on a rounding edge.
    expected = reference_outputs(_plain(family_model), requests, ExitPolicy.FIXED)
    executor = Executor(family_model, num_blocks=200, block_size=4, exit_policy=ExitPolicy.FIXED)
    assert Driver(executor, requests, DriverConfig(chunk_size=5)).run() == expected


def test_one_rotation_of_q_and_k_is_textbook_rotate_half() -> None:
    head_dim, theta = 16, 10000.0
    table = RotaryTable(head_dim, theta, RopeScaling(), torch.device("cpu"))
    positions = torch.tensor([0, 3, 300, 7])
    x = torch.randn(4, 5, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(positions.float(), inv_freq.float())
    cos = torch.cat([angles, angles], -1).cos()[:, None]
    sin = torch.cat([angles, angles], -1).sin()[:, None]
    half = head_dim // 2
    textbook = x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin
    assert torch.equal(table.at(positions, 300).rotate(x), textbook)


def test_planned_kv_write_matches_the_reference() -> None:
    cache_shape = (6, 4, 2, 8)  # [num_blocks, block_size, Hkv, D]
    key_cache, value_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 8, 22])
    expected = write_kv_reference(key, value, key_cache, value_cache, slots)
    plan = kernels.plan_write_kv(slots, num_blocks=6, block_size=4)
    kernels.write_kv(key, value, key_cache, value_cache, slots, plan=plan)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


def test_kv_write_plan_checks_once_and_must_match() -> None:
    with pytest.raises(ValueError, match="one slot twice"):
        kernels.plan_write_kv(torch.tensor([1, 1]), num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="8 slots"):
        kernels.plan_write_kv(torch.tensor([8]), num_blocks=2, block_size=4)
    slots = torch.tensor([0, 5])
    plan = kernels.plan_write_kv(slots, num_blocks=2, block_size=4)
    cache = torch.zeros(2, 4, 1, 8)
    key = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="another slot_mapping"):
        kernels.write_kv(key, key, cache, cache.clone(), slots.clone(), plan=plan)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        bigger = torch.zeros(3, 4, 1, 8)
        kernels.write_kv(key, key, bigger, bigger.clone(), slots, plan=plan)
