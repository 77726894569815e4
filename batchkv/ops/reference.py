"""Pure-torch references of the sdpa_varlen contract and the step's K/V write.

These are the oracles: the Triton kernels must match them, and the cache uses them where there is
no GPU. They read `seq_info` on the host (`tolist()`), so they are not capturable in a CUDA graph.

Contract (`sdpa_varlen`), for each row s of `seq_info` = (q_start, q_len, col, kv_end):
- query i in [0, q_len) is packed row `q_start + i` and sits at position `p_i = kv_end - q_len + i`;
- causal rows attend keys t in [lo_i, p_i], lo_i = max(0, p_i - window + 1) when windowed, else 0;
- non-causal rows attend t in [lo, kv_end), lo = max(0, kv_end - window) when windowed, else 0;
- only t >= kv_end - rows is resident (ring storage); key t lives at store[t % rows, col];
- GQA: query head h reads KV head h // (Hq // Hkv);
- rows of q no segment covers, and rows with no resident key, come out as exact zeros.
"""

from __future__ import annotations

import math

import torch


def sdpa_varlen_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
) -> torch.Tensor:
    """Attention of packed queries over the column store, computed in float32.

    q: [T, Hq, D]; k_store, v_store: [rows, C, Hkv, D]; seq_info: int [S, 4] (any device).
    Returns [T, Hq, D] in q's dtype. Not graph-capturable (reads seq_info on the host).

    >>> out = sdpa_varlen_reference(q, k, v, torch.tensor([[0, 3, 1, 3]], dtype=torch.int32))
    """
    num_tokens, num_q_heads, head_dim = q.shape
    rows, _, num_kv_heads, _ = k_store.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for q_start, q_len, col, kv_end in seq_info.tolist():
        if q_len <= 0:
            continue
        lo_resident = max(0, kv_end - rows)
        if lo_resident >= kv_end:
            continue
        t = torch.arange(lo_resident, kv_end, device=q.device)  # resident key positions
        keys = k_store[t % rows, col].float().repeat_interleave(group, dim=1)  # [N, Hq, D]
        values = v_store[t % rows, col].float().repeat_interleave(group, dim=1)
        p = torch.arange(kv_end - q_len, kv_end, device=q.device)  # [q_len] query positions
        if causal:
            allowed = t[None, :] <= p[:, None]
            if window:
                allowed &= t[None, :] > p[:, None] - window
        else:
            allowed = torch.ones(q_len, t.numel(), dtype=torch.bool, device=q.device)
            if window:
                allowed &= (t >= kv_end - window)[None, :]
        queries = q[q_start : q_start + q_len].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key gives zeros
        # Masked keys can hold NaN (never-written storage); zero them so 0 * NaN cannot leak.
        values = values.masked_fill(~allowed.any(0)[:, None, None], 0.0)
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def kv_write_reference(
    k_flat: torch.Tensor, v_flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write this step's K/V rows into the flat store views: `k_flat[slots[i]] = k[i]`.

    k_flat, v_flat: [rows * C, Hkv, D] views of the store; k, v: [W, Hkv, D]; slots: int64 [W].
    Cast to the store's dtype on write. Capturable (no host reads).
    """
    k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, v.to(v_flat.dtype))
