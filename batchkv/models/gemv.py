"""Linear layers at a few rows: `y = x @ W.T` streamed at the weight-read bandwidth (Triton, CUDA).

A decode step of one or a few sequences is weight-read bound: each projection reads its whole
[N, K] weight once for a handful of rows. cuBLAS's GEMM tilings leave some of the read bandwidth
unused on the SenseNova-U1 shapes at one row; this kernel is built for the case instead:

- one program per BLOCK_N output features, walking K in [BLOCK_N, BLOCK_K] weight tiles with a
  software pipeline of `num_stages` tiles in flight, so every SM keeps enough bytes requested;
- the rows (M <= 16) are padded to one 16-row tensor-core tile, `acc [16, BLOCK_N] += x_tile @ w_tile.T`
  in fp32 (IEEE dots for fp32 weights): the tensor cores are idle most of the time anyway, and the
  padding costs no bytes;
- the result is rounded to x's dtype (as F.linear rounds) and then stored in `out_dtype`, so the LM
  head writes its float32 logits without another cast launch.

Measured on the H200 at one row (bench/results/gemv-h200.json; median of graph replays, weights
read from HBM): q/k/v 14.7-15.2 us against cuBLAS's 16.5, o 9.9 against 13.2, gate/up 48.4 against
49.5, down 25.7 against 30.2, the LM head 279 against 302. Feeding SiLU(gate) * up into the down
projection's tiles was 3-5x slower than cuBLAS (the elementwise work sits in the pipelined loop),
so the down projection takes the `silu_mul` kernel, then this kernel on its output. `TUNED` holds
the measured tile choices per weight shape; other shapes take `resolve`'s heuristic.

`linear(x, w)` dispatches: this kernel on CUDA for M <= `GEMV_MAX_ROWS`, else `F.linear` (cuBLAS
wins with more rows). Capturable: fixed grid (N / BLOCK_N programs), no host reads.
On sm_90+ a programmatic dependent launch (`ops/pdl.py`): its launch overlaps the kernel before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchkv.errors import ContractError
from batchkv.models.fused import silu_mul as silu_mul_rows
from batchkv.ops.support import sm_count

try:
    import triton
    import triton.language as tl

    from batchkv.ops.pdl import pdl_enter, pdl_kwargs
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

GEMV_MAX_ROWS = 4  # rows up to which `linear` takes the kernel on CUDA (cuBLAS from there on)
MAX_ROWS = 16  # the kernel's row tile


@dataclass(frozen=True)
class GemvConfig:
    """Tile choices; 0 fields come from `resolve` (block_n from N and the SM count)."""

    block_n: int = 0
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


# (N, K) -> (block_n, block_k, num_stages), the fastest of bench/gemv.py's grid at one row on the H200.
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (64, 256, 5),  # SenseNova-U1-8B q/k/v
    (4096, 4096): (32, 256, 5),  # o
    (24576, 4096): (64, 128, 3),  # gate/up
    (4096, 12288): (32, 256, 5),  # down
    (151936, 4096): (64, 256, 3),  # LM head
}


def resolve(config: GemvConfig | None, n: int, device: torch.device, k: int = 0) -> GemvConfig:
    """`config`, else the measured choice for an [n, k] weight, else the widest tile (64, 32, 16)
    that still gives every SM two programs."""
    if config is None and (n, k) in TUNED:
        block_n, block_k, stages = TUNED[(n, k)]
        return GemvConfig(block_n, block_k, 4, stages)
    cfg = config or GemvConfig()
    if cfg.block_n:
        return cfg
    sms = sm_count(device)
    block_n = next((b for b in (64, 32) if n // b >= 2 * sms), 16)
    return GemvConfig(block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                     GDC: tl.constexpr):  # fmt: skip
        pdl_enter(GDC)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok = (n < N)[:, None]
        m_ok = (m < M)[:, None]
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            k_ok = k < K
            w = tl.load(w_rows + k, mask=n_ok & k_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_rows + k, mask=m_ok & k_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # round as F.linear does
        ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(ptrs, out, mask=m_ok & (n < N)[None, :])


def gemv(
    x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """`x @ w.T` for x [M, K] (M <= 16) and w [N, K], one launch.

    x and w share a float dtype, w is row-contiguous, x's last dim contiguous. Returns [M, N] in
    `out_dtype` (default x's dtype), rounded to x's dtype first. Capturable (grid N / block_n).

    >>> y = gemv(x, model.layers[0].qkv)   # x [1, 4096] bf16 -> [1, 6144]
    """
    if triton is None:
        raise ContractError("gemv needs Triton; use torch.nn.functional.linear")
    if x.dim() != 2 or w.dim() != 2:
        raise ContractError(f"gemv wants x [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k or not 0 < m <= MAX_ROWS:
        raise ContractError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (K={k}; 1..{MAX_ROWS} rows)")
    if x.dtype != w.dtype or not x.dtype.is_floating_point or x.device != w.device:
        raise ContractError(f"gemv: x and w must share a float dtype and device; got {x.dtype}/{w.dtype}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ContractError("gemv: x and w need a contiguous last dim")
    cfg = resolve(config, n, x.device, k)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor, w: torch.Tensor | torch.nn.Module, *, silu_mul: bool = False, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`F.linear(x, w)` (of silu(gate) * up for x = [gate | up] when silu_mul), in `out_dtype`.

    The few-row kernel on CUDA for up to GEMV_MAX_ROWS rows, cuBLAS otherwise; with silu_mul the
    elementwise kernel runs first. Both round the product to x's dtype. The row count is static per
    captured width, so a graph takes one path. `w` may also be a layer that computes itself with the
    same keywords (a `batchkv.models.quant.Fp8Linear` put in place of a weight at load).
    """
    if not isinstance(w, torch.Tensor):
        return w(x, silu_mul=silu_mul, out_dtype=out_dtype)
    if silu_mul:
        x = silu_mul_rows(x)
    if x.is_cuda and triton is not None and x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, w, out_dtype=out_dtype)
    y = F.linear(x, w)
    return y if out_dtype is None else y.to(out_dtype)
