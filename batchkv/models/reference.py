"""Eager reference forward of SenseNova-U1 for ONE sequence: the oracle of the model tests.

It shares only the weights with `SenseNovaLM` (read under their checkpoint names, so a fusion-order
mistake shows up as a mismatch) and computes the math of `batchkv.models.sensenova` the plain
way: per-section rotate-half RoPE built from chunks, K/V grown with `torch.cat`, attention by
`torch.nn.functional.scaled_dot_product_attention`. It never touches a BatchedSequenceCache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from batchkv.models.sensenova import SenseNovaLM
from batchkv.models.weights import named_weights

Past = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [Hkv, T, D]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Standard rotate-half RoPE of x [L, H, n] at positions [L] with base theta."""
    n = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, n, 2, dtype=torch.float32, device=x.device) / n))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    return x * cos + _rotate_half(x) * sin


def _qk(x: torch.Tensor, w_t, w_hw, indexes: torch.Tensor, model: SenseNovaLM) -> torch.Tensor:
    """Split QK-norm then 3-D RoPE of x [L, H, D]."""
    cfg = model.config
    x_t, x_hw = x.chunk(2, dim=-1)
    x_t, x_hw = _norm(x_t, w_t, cfg.rms_eps), _norm(x_hw, w_hw, cfg.rms_eps)
    x_h, x_w = x_hw.chunk(2, dim=-1)
    return torch.cat(
        (
            _rope(x_t, indexes[0], cfg.theta_t),
            _rope(x_h, indexes[1], cfg.theta_hw),
            _rope(x_w, indexes[2], cfg.theta_hw),
        ),
        dim=-1,
    )


@torch.no_grad()
def reference_logits(
    model: SenseNovaLM, input_ids: torch.Tensor, indexes: torch.Tensor, past: Past | None = None
) -> tuple[torch.Tensor, Past]:
    """Logits of a block of one sequence after `past`.

    input_ids int64 [L], indexes int64 [3, L] (text: (t, 0, 0)); past from a previous call (None:
    the block starts the sequence). Returns (float32 [L, vocab], past extended by the block).
    Causal inside the block; the block sees all of `past`.
    """
    cfg, w = model.config, dict(named_weights(model))
    n, d, hq, hkv = input_ids.shape[0], cfg.head_dim, cfg.q_heads, cfg.kv_heads
    past_len = 0 if past is None else past[0][0].shape[1]
    if past is None:
        mask, causal = None, True
    else:  # query i sits at position past_len + i and sees keys j <= past_len + i
        keys = torch.arange(past_len + n, device=input_ids.device)
        mask, causal = keys[None, :] <= (past_len + torch.arange(n, device=input_ids.device))[:, None], False
    new_past: Past = []
    h = w["model.embed_tokens.weight"][input_ids]
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        x = _norm(h, w[p + "input_layernorm.weight"], cfg.rms_eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, hq, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, hkv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, hkv, d)
        q = _qk(q, w[p + "self_attn.q_norm.weight"], w[p + "self_attn.q_norm_hw.weight"], indexes, model)
        k = _qk(k, w[p + "self_attn.k_norm.weight"], w[p + "self_attn.k_norm_hw.weight"], indexes, model)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
        if past is not None:
            k, v = torch.cat((past[layer][0], k), dim=1), torch.cat((past[layer][1], v), dim=1)
        new_past.append((k, v))
        group = hq // hkv
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.repeat_interleave(group, dim=0)[None],
            v.repeat_interleave(group, dim=0)[None],
            attn_mask=mask,
            is_causal=causal,
            scale=d**-0.5,
        )  # [1, Hq, L, D]
        h = h + out[0].transpose(0, 1).reshape(n, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        x = _norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = _norm(h, w["model.norm.weight"], cfg.rms_eps)
    return (h @ w["lm_head.weight"].T).float(), new_past


def text_indexes(start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE indexes int64 [3, n] of n text tokens whose t runs from `start`: (t, 0, 0)."""
    idx = torch.zeros(3, n, dtype=torch.int64, device=device)
    idx[0] = torch.arange(start, start + n, device=device)
    return idx


@torch.no_grad()
def reference_generate(
    model: SenseNovaLM, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy continuation of a text prompt (t index = position). Returns the new tokens only;
    a stop id ends the run and is included as the last token.
    """
    device = model.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)
    logits, past = reference_logits(model, ids, text_indexes(0, len(ids), device))
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in stop_ids:
            break
        t = len(prompt_ids) + len(out) - 1
        step = torch.tensor([token], dtype=torch.int64, device=device)
        logits, past = reference_logits(model, step, text_indexes(t, 1, device), past)
    return out
