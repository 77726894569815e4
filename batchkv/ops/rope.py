"""Rotate-half RoPE (transformers' `apply_rotary_pos_emb`) of a step's packed rows, for the K/V write.

A transformers model's attention rotates q and k and hands them on; `kv_write` can take them
unrotated with the step's cos and sin (`rope=`) and rotate both in its own launch (k on its way into
the store, q into a new tensor the attention reads), one launch a layer fewer than a RoPE kernel
followed by the write. The arithmetic is torch's three ops: x * cos and rotate_half(x) * sin each
rounded to x's dtype, then their sum rounded (rotate_half's negation is exact), so either path stores
the same bits in 16 bits (in fp32 the casts are no-ops and the GPU compiler may contract a product into
the sum: within an ulp).

- `rope_rows(x, cos, sin)`: x [W, H, D], cos and sin [W, D] -> [W, H, D] in torch ops (the reference
  attention's path, the oracle, and `batchkv.models.fused.rope_qk_torch` on transformers' [B, H, W, D]);
- `kv_write_triton.rotate_half_rope`: the same on a Triton tile (`kv_write`'s and `batchkv.models.fused`'s
  RoPE kernel), apart so this module needs no Triton;
- `rope_problem(q, k, cos, sin)`: why these cannot be rotated together (None when they can);
  `check_rope` raises it for `sdpa_varlen(rope=)`, `rotate_step` checks and rotates (the reference's path).
"""

from __future__ import annotations

import torch

from batchkv.errors import ContractError


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by cos, sin as transformers' `apply_rotary_pos_emb` rotates it, op for op: heads on x's dim 1
    (packed rows [W, H, D], or transformers' [B, H, W, D]), cos and sin x's shape without it ([W, D], [B, W, D])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def rope_problem(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why q [W, Hq, D] and k [W, Hkv, D] cannot be rotated by cos, sin [W, D] in one launch, or None."""
    width, _, dim = q.shape
    if cos.dim() != 2 or cos.shape != sin.shape or tuple(cos.shape) != (width, dim) or k.shape[0] != width:
        got = f"{list(cos.shape)}, {list(sin.shape)}"
        return f"rope's cos and sin must be [W, D] = [{width}, {dim}] as q and k; got {got}"
    if dim % 2 or k.shape[2] != dim:
        return f"rope rotates halves of one even head width for q and k; got q's {dim}, k's {k.shape[2]}"
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        return f"rope wants q, k, cos and sin of one dtype; got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}"
    if cos.device != q.device or sin.device != q.device:
        return f"rope's cos and sin must be on q's device {q.device}; got {cos.device}, {sin.device}"
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        return "rope's cos and sin need a contiguous last dim and the same strides"
    return None


def check_rope(q: torch.Tensor, write: tuple | None, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise ContractError unless `rope` = (cos, sin) can rotate q and the K rows of `write` = (k, v, slots)."""
    if write is None:
        raise ContractError("sdpa_varlen: rope rotates the step's K rows as they are written; pass write=(k, v, slots)")
    problem = rope_problem(q, write[0], *rope)
    if problem:
        raise ContractError(f"sdpa_varlen: {problem}")


def rotate_step(q: torch.Tensor, write: tuple | None, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """(q, write) with q and write's K rows rotated by `rope` = (cos, sin) in torch ops, once `check_rope` passes."""
    check_rope(q, write, rope)
    k, *rest = write
    return rope_rows(q, *rope), (rope_rows(k, *rope), *rest)
