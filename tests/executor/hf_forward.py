"""A from-scratch full-sequence forward written straight from the Hugging Face tensor names and
the Llama / Ouro modeling code's equations — no KV cache, no fused weights, no shared code with
kvgate's model, so a swapped projection or a misplaced norm in kvgate cannot hide."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [heads, seq, dim]: rotate pairs (i, i + dim/2) by position * inv_freq[i]."""
    seq = x.shape[1]
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def hf_last_logits(
    tensors: dict[str, torch.Tensor], config: dict[str, object], token_ids: list[int]
) -> torch.Tensor:
    """Logits ``[V]`` of the last position after a full forward (every loop for Ouro)."""
    t = {k: v.float() for k, v in tensors.items()}
    hidden_size = int(config["hidden_size"])  # type: ignore[call-overload]
    heads = int(config["num_attention_heads"])  # type: ignore[call-overload]
    kv_heads = int(config["num_key_value_heads"])  # type: ignore[call-overload]
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    eps = float(config["rms_norm_eps"])  # type: ignore[arg-type]
    head_dim = hidden_size // heads
    theta = float(config["rope_theta"])  # type: ignore[arg-type]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ouro = config["model_type"] == "ouro"
    loops = int(config.get("total_ut_steps", 1)) if ouro else 1  # type: ignore[call-overload]
    seq = len(token_ids)
    h = t["model.embed_tokens.weight"][torch.tensor(token_ids)]
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    for _ in range(loops):
        for i in range(layers):
            p = f"model.layers.{i}."
            x = _norm(h, t[p + "input_layernorm.weight"], eps)
            q = x @ t[p + "self_attn.q_proj.weight"].T
            k = x @ t[p + "self_attn.k_proj.weight"].T
            v = x @ t[p + "self_attn.v_proj.weight"].T
            if p + "self_attn.q_proj.bias" in t:
                q = q + t[p + "self_attn.q_proj.bias"]
                k = k + t[p + "self_attn.k_proj.bias"]
                v = v + t[p + "self_attn.v_proj.bias"]
            q = _rope(q.view(seq, heads, head_dim).transpose(0, 1), inv_freq)
            k = _rope(k.view(seq, kv_heads, head_dim).transpose(0, 1), inv_freq)
            v = v.view(seq, kv_heads, head_dim).transpose(0, 1)
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
            scores = q @ k.transpose(1, 2) / math.sqrt(head_dim) + mask
            attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, heads * head_dim)
            attn = attn @ t[p + "self_attn.o_proj.weight"].T
            if ouro:
                attn = _norm(attn, t[p + "input_layernorm_2.weight"], eps)
            h = h + attn
            x = _norm(h, t[p + "post_attention_layernorm.weight"], eps)
            gate = x @ t[p + "mlp.gate_proj.weight"].T
            up = x @ t[p + "mlp.up_proj.weight"].T
            mlp = (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
            if ouro:
                mlp = _norm(mlp, t[p + "post_attention_layernorm_2.weight"], eps)
            h = h + mlp
        if ouro:
            h = _norm(h, t["model.norm.weight"], eps)
    if not ouro:
        h = _norm(h, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return h[-1] @ head.T
