"""Mixture-of-experts expert computation: the argument checks and the plain-torch specification.

Every token ``t`` was routed (by the model's router, outside this module) to ``k`` experts
``topk_ids[t, 0..k)`` with weights ``topk_weights[t, 0..k)``. Expert ``e`` is a SwiGLU MLP whose
gate and up projections are stacked in ``gate_up[e]`` (rows ``[0, I)`` the gate, ``[I, 2I)`` the
up projection, as transformers 5 stores ``experts.gate_up_proj``) and whose down projection is
``down[e]``::

    out[t] = sum_j  topk_weights[t, j] * down[e_j] @ (silu(gate[e_j] @ x[t]) * (up[e_j] @ x[t]))
             e_j = topk_ids[t, j]

:func:`fused_experts_reference` is that formula, written for clarity: each expert's rows run
through ``F.linear`` in the input dtype (as transformers' experts do), the weighting and the sum
over ``j`` (in ``j`` order) in float32, the result cast back to the input dtype. The Triton
kernel (:mod:`kvgate.kernels.triton_moe`) and the executor's CPU path are tested against it.

A (token, slot) pair is called a *pair*: pair ``p = t * k + j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ID_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_experts_args(
    x: torch.Tensor,  # [n, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float32 [n, k]
    topk_ids: torch.Tensor,  # int32/int64 [n, k], values in [0, E)
) -> None:
    """Raise ValueError/TypeError naming the argument, before anything is computed.

    Shapes, dtypes and devices always; the ids' values only on CPU (on CUDA reading them would
    synchronise the stream on every layer; the router produces them in range by construction).
    """
    tensors = {"x": x, "gate_up": gate_up, "down": down}
    tensors |= {"topk_weights": topk_weights, "topk_ids": topk_ids}
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    layouts = {
        "x": (x, "[n, H]"),
        "gate_up": (gate_up, "[E, 2 I, H]"),
        "down": (down, "[E, H, I]"),
        "topk_weights": (topk_weights, "[n, k]"),
        "topk_ids": (topk_ids, "[n, k]"),
    }
    for name, (tensor, layout) in layouts.items():
        if tensor.dim() != layout.count(",") + 1:
            raise ValueError(f"{name} must be {layout}, got shape {_shape(tensor)}")
    if x.dtype not in EXPERT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    for name in ("gate_up", "down"):
        if tensors[name].dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {tensors[name].dtype}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    num_experts, two_inter, hidden = gate_up.shape
    if two_inter % 2:
        raise ValueError(f"gate_up's second dimension (2 I) must be even, got {two_inter}")
    if x.shape[1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[1]}, gate_up {_shape(gate_up)} has {hidden}")
    if down.shape != (num_experts, hidden, two_inter // 2):
        expected = f"[{num_experts}, {hidden}, {two_inter // 2}]"
        raise ValueError(f"down must be {expected} to match gate_up, got {_shape(down)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {_shape(topk_ids)} and topk_weights {_shape(topk_weights)} must both be "
            f"[n, k] with n = {x.shape[0]} (x's rows)"
        )
    if topk_ids.shape[1] > num_experts:
        raise ValueError(f"top-k {topk_ids.shape[1]} exceeds the {num_experts} experts")
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}), got [{low}, {high}]")


def fused_experts_reference(
    x: torch.Tensor,  # [n, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]: gate rows [0, I), up rows [I, 2 I)
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float32 [n, k]
    topk_ids: torch.Tensor,  # int [n, k]
) -> torch.Tensor:  # [n, H], x's dtype
    """The specification (module docstring): one expert at a time, its pairs gathered."""
    check_experts_args(x, gate_up, down, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    pair_out = torch.zeros(num_tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        pair_out[tokens, slots] = expert_out.float() * topk_weights[tokens, slots, None]
    return pair_out.sum(dim=1).to(x.dtype)
