"""Fused elementwise kernels of a decoder layer, so a decode step is the matmuls plus a few launches.

Decode is weight-read bound, and at one to 64 rows every extra launch between the matmuls costs a
few microseconds even inside a CUDA graph; a 42-layer step would spend milliseconds in them. Three
Triton kernels cover everything between the matmuls (attention aside):

- `add_rms_norm(h, delta, weight, eps) -> (h + delta, RMSNorm(h + delta) * weight)`  [W, H]; the same
  kernel without the add is `rms_norm(x, weight, eps)` over the last dim of any x, in each of
  transformers' roundings (`batchkv.models.hf_norms` puts it in place of their RMSNorm modules); it
  also writes the e4m3 codes and scales of its output for an FP8 reader (`batchkv.models.quant.producers`)
- `qk_norm_rope(qkv, q_norm, k_norm, cos, sin, q_heads, kv_heads) -> (q, k)`: the split QK-norm
  (one RMSNorm over each half of head_dim, its own [2, D/2] weight for q and for k) and the
  rotate-half RoPE with per-dim tables: one head per program at few rows, a block of heads at many.
- `silu_mul(gate_up) -> silu(gate) * up` for gate_up = [gate | up], [W, 2I] -> [W, I].

Each has a torch implementation with the same rounding (normalise in float32, round to the input
dtype, then scale by the weight), used on CPU and as the test oracle; the Triton one runs on CUDA
(and under TRITON_INTERPRET=1 in tests). All are capturable: fixed grids, no host reads. On sm_90+
each is a programmatic dependent launch (`ops/pdl.py`): its launch overlaps the kernel before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchkv.ops.rope import rope_rows

try:
    import triton
    import triton.language as tl

    from batchkv.ops.kv_write_triton import rope_partner, rotate_half_rope
    from batchkv.ops.pdl import pdl_enter, pdl_kwargs
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


QK_BLOCK = 1024  # elements of one qk_norm_rope program past QK_FEW_PROGRAMS: 8 heads of 128
QK_FEW_PROGRAMS = 2048  # (row, head) pairs up to which qk_norm_rope runs one head per program
# (bench/results/qk-norm-rope-h200.json: the block kernel at one row took 1.4 against 1.05 us a call)


def _use_triton(x: torch.Tensor, force: bool | None) -> bool:
    return (x.is_cuda if force is None else force) and triton is not None


# ---- torch versions (CPU path and oracle) ------------------------------------------------------
def add_rms_norm_torch(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + delta
    return h, F.rms_norm(h, (h.shape[-1],), eps=eps) * weight


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, round_first: bool = True):
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_first:  # transformers' Llama: the weight times the normed row in x's dtype
        return weight * normed.to(x.dtype)
    return (normed * (offset + weight.float() if offset else weight.float())).to(x.dtype)  # Gemma, Olmo2


def rope_qk_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return rope_rows(q, cos, sin), rope_rows(k, cos, sin)  # transformers' apply_rotary_pos_emb, op for op


def qk_norm_rope_torch(qkv, q_norm, k_norm, cos, sin, partner, q_heads: int, kv_heads: int, eps: float):
    w, d = qkv.shape[0], q_norm.shape[-1] * 2
    qk = F.rms_norm(qkv[:, : (q_heads + kv_heads) * d].view(w, q_heads + kv_heads, 2, d // 2), (d // 2,), eps=eps)
    qk = torch.cat([qk[:, :q_heads] * q_norm, qk[:, q_heads:] * k_norm], dim=1).view(w, q_heads + kv_heads, d)
    qk = torch.addcmul(qk * cos[:, None], qk.index_select(-1, partner), sin[:, None])
    return qk[:, :q_heads], qk[:, q_heads:]


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out, x_out, q_ptr, s_ptr, rows, n, eps, HAS_DELTA: tl.constexpr,
                         OFFSET: tl.constexpr, ROUND_FIRST: tl.constexpr, STORE_X: tl.constexpr, QUANT: tl.constexpr,
                         INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         GDC: tl.constexpr):  # fmt: skip
        # ROWS rows of n per program. HAS_DELTA: h + delta first (stored to h_out, rounded to h's dtype).
        # ROUND_FIRST (Llama): normed rounded to h's dtype, then * weight, rounded to x_out's dtype;
        # else (Gemma, Olmo2): normed * (weight + OFFSET) in float32, rounded once. STORE_X: that row to
        # x_out. QUANT: its e4m3 codes (q_ptr) and per-row scales (s_ptr) as `quantize_rows` computes them.
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (row < rows) & (cols < n)
        h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(d_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
            tl.store(h_out + row * n + cols, h, mask=mask)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / n + eps)
        weight = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        if OFFSET != 0.0:
            weight = weight + OFFSET
        normed = hf * rstd[:, None]
        if ROUND_FIRST:
            normed = normed.to(h.dtype).to(tl.float32)
        x = (normed * weight).to(x_out.dtype.element_ty)
        if STORE_X:
            tl.store(x_out + row * n + cols, x, mask=mask)
        if QUANT:  # x as rounded; 0 past n (the weight loads 0 there)
            xf = x.to(tl.float32)
            nan = tl.sum((xf != xf).to(tl.int32), axis=1) > 0
            scale = tl.maximum(tl.max(tl.abs(xf), axis=1) * INV_MAX, MIN_SCALE)
            scale = tl.where(nan, float("nan"), scale)[:, None]  # tl.max and tl.maximum drop NaN
            v = tl.math.div_rn(xf, scale)
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
            tl.store(q_ptr + row * n + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + row, scale, mask=row < rows)

    @triton.jit
    def _rope_partner(offs, D: tl.constexpr):
        # Sections t [0, D/2), h [D/2, 3D/4), w [3D/4, D): dim j of a section of size n pairs with
        # j + n/2 in the first half of the section and j - n/2 in the second (sign folded into sin).
        half: tl.constexpr = D // 2
        quarter: tl.constexpr = D // 4
        size = tl.where(offs < half, half, quarter)
        start = tl.where(offs < half, 0, tl.where(offs < half + quarter, half, half + quarter))
        return tl.where(offs - start < size // 2, offs + size // 2, offs - size // 2)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_out, k_out, row_stride, eps,
        Q_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, head): x [D] -> split RMSNorm -> RoPE (rotate half within sections).
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        offs = tl.arange(0, D)
        base = qkv_ptr + row * row_stride + head * D
        x = tl.load(base + offs).to(tl.float32)  # [D]
        is_hi = offs >= half
        sq = x * x
        ms_lo = tl.sum(tl.where(is_hi, 0.0, sq), axis=0) / half
        ms_hi = tl.sum(tl.where(is_hi, sq, 0.0), axis=0) / half
        rstd = tl.where(is_hi, 1.0 / tl.sqrt(ms_hi + eps), 1.0 / tl.sqrt(ms_lo + eps))
        partner = _rope_partner(offs, D)
        x_partner = tl.load(base + partner).to(tl.float32)  # same half, so the same rstd
        if head < Q_HEADS:
            w = tl.load(qn_ptr + offs).to(tl.float32)
            w_partner = tl.load(qn_ptr + partner).to(tl.float32)
        else:
            w = tl.load(kn_ptr + offs).to(tl.float32)
            w_partner = tl.load(kn_ptr + partner).to(tl.float32)
        dtype = q_out.dtype.element_ty
        y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        y_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + row * D + offs).to(tl.float32)
        sin = tl.load(sin_ptr + row * D + offs).to(tl.float32)
        # torch rounds x*cos and the fused addcmul once each; match that order.
        out = ((y * cos).to(dtype).to(tl.float32) + y_partner * sin).to(dtype)
        if head < Q_HEADS:
            tl.store(q_out + (row * Q_HEADS + head) * D + offs, out)
        else:
            tl.store(k_out + (row * (HEADS - Q_HEADS) + head - Q_HEADS) * D + offs, out)

    @triton.jit
    def _qk_norm_rope_block_kernel(
        qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_out, k_out, row_stride, eps,
        Q_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, HB heads): `_qk_norm_rope_kernel` on a [HB, D] tile. At hundreds of
        # rows a one-warp program per head spent its time being scheduled, not moving bytes.
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
        live = (heads < HEADS)[:, None]
        is_q = (heads < Q_HEADS)[:, None]
        half: tl.constexpr = D // 2
        offs = tl.arange(0, D)
        base = qkv_ptr + row * row_stride + heads[:, None] * D
        x = tl.load(base + offs[None, :], mask=live, other=0.0).to(tl.float32)  # [HB, D]
        is_hi = (offs >= half)[None, :]
        sq = x * x
        ms_lo = tl.sum(tl.where(is_hi, 0.0, sq), axis=1) / half
        ms_hi = tl.sum(tl.where(is_hi, sq, 0.0), axis=1) / half
        rstd = tl.where(is_hi, 1.0 / tl.sqrt(ms_hi[:, None] + eps), 1.0 / tl.sqrt(ms_lo[:, None] + eps))
        partner = _rope_partner(offs, D)
        x_partner = tl.load(base + partner[None, :], mask=live, other=0.0).to(tl.float32)  # same half: same rstd
        w = tl.where(is_q, tl.load(qn_ptr + offs)[None, :], tl.load(kn_ptr + offs)[None, :]).to(tl.float32)
        w_partner = tl.where(is_q, tl.load(qn_ptr + partner)[None, :], tl.load(kn_ptr + partner)[None, :])
        w_partner = w_partner.to(tl.float32)
        dtype = q_out.dtype.element_ty
        y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        y_partner = ((x_partner * rstd).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + row * D + offs).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + row * D + offs).to(tl.float32)[None, :]
        # torch rounds x*cos and the fused addcmul once each; match that order.
        out = ((y * cos).to(dtype).to(tl.float32) + y_partner * sin).to(dtype)
        q_at = q_out + (row * Q_HEADS + heads[:, None]) * D + offs[None, :]
        tl.store(q_at, out, mask=live & is_q)
        k_at = k_out + (row * (HEADS - Q_HEADS) + heads[:, None] - Q_HEADS) * D + offs[None, :]
        tl.store(k_at, out, mask=live & ~is_q)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, q_sh, q_sw, k_sh, k_sw, qo_sh, qo_sw, ko_sh, ko_sw, cos_sw,
        Q_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, HB heads of q then k): x * cos + rotate_half(x) * sin, each product and
        # the sum rounded to the output dtype as torch's three ops are (rotate_half's negation is exact).
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]  # [HB, 1]
        offs = tl.arange(0, D)[None, :]
        partner, sign = rope_partner(offs, D)
        is_q = heads < Q_HEADS
        live_q = is_q & (offs < D)
        live_k = (~is_q) & (heads < HEADS) & (offs < D)
        kh = heads - Q_HEADS
        q_at = q_ptr + row * q_sw + heads * q_sh
        k_at = k_ptr + row * k_sw + kh * k_sh
        x = tl.where(is_q, tl.load(q_at + offs, mask=live_q, other=0.0), tl.load(k_at + offs, mask=live_k, other=0.0))
        xp = tl.where(is_q, tl.load(q_at + partner, mask=live_q, other=0.0),
                      tl.load(k_at + partner, mask=live_k, other=0.0))  # fmt: skip
        cos = tl.load(cos_ptr + row * cos_sw + offs).to(tl.float32)
        sin = tl.load(sin_ptr + row * cos_sw + offs).to(tl.float32)
        out = rotate_half_rope(x, xp, cos, sin, sign, q_out.dtype.element_ty)
        tl.store(q_out + row * qo_sw + heads * qo_sh + offs, out, mask=live_q)
        tl.store(k_out + row * ko_sw + kh * ko_sh + offs, out, mask=live_k)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(gu_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# ---- dispatch ---------------------------------------------------------------------------------
def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, triton_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for contiguous [W, H] h and delta. One launch on CUDA."""
    if not _use_triton(h, triton_kernel):
        return add_rms_norm_torch(h, delta, weight, eps)
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    norm_launch(h, weight, eps, delta=delta.contiguous(), h_out=h_out, out=x_out)
    return h_out, x_out


RMS_NORM_MAX = 16384  # the widest row `rms_norm` runs in one program; wider ones take the torch path
RMS_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def norm_kernel_ok(x: torch.Tensor, weight: torch.Tensor, triton_kernel: bool | None = None) -> bool:
    """Whether `rms_norm` of x with weight runs the kernel: CUDA (or `triton_kernel`), rows up to
    RMS_NORM_MAX, float16/bfloat16/float32, nothing for autograd to record."""
    use = _use_triton(x, triton_kernel) and x.shape[-1] <= RMS_NORM_MAX
    use = use and {x.dtype, weight.dtype} <= set(RMS_NORM_DTYPES)
    return use and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def norm_out_dtype(x: torch.Tensor, weight: torch.Tensor, round_first: bool) -> torch.dtype:
    """The dtype of `rms_norm(x, weight, ...)`: weight's and x's promoted (round_first), else x's."""
    return torch.promote_types(weight.dtype, x.dtype) if round_first else x.dtype


def norm_launch(
    x2: torch.Tensor, weight: torch.Tensor, eps: float, *, delta: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None, out: torch.Tensor | None = None, quant: tuple | None = None,
    offset: float = 0.0, round_first: bool = True,
) -> None:  # fmt: skip
    """One launch of the norm kernel over contiguous rows x2 [R, n]: with `delta` [R, n], h_out = x2 + delta
    (rounded to x2's dtype) is what is normed; `out` (if given) gets the normed rows (`rms_norm`'s
    roundings; without `out` they are rounded to x2's dtype); `quant` = (codes [R, n] e4m3, scales [R, 1]
    float32, inv_max, min_scale) gets their e4m3 codes and per-row scales, as
    `batchkv.models.quant.fp8.quantize_rows` computes them from the rounded rows. Capturable."""
    rows, n = x2.shape
    if not rows:
        return
    block = triton.next_power_of_2(n)
    per = max(1, min(16, 1024 // block))  # several short rows per program (a Qwen3 head's q/k-norm)
    codes, scales, inv_max, min_scale = quant if quant is not None else (x2, x2, 0.0, 0.0)
    dummy = h_out if h_out is not None else x2  # rounds as x2's dtype where `out` is not stored
    _rms_norm_kernel[(triton.cdiv(rows, per),)](
        x2, x2 if delta is None else delta, weight.contiguous(), dummy, dummy if out is None else out, codes,
        scales, rows, n, eps, HAS_DELTA=delta is not None, OFFSET=float(offset), ROUND_FIRST=round_first,
        STORE_X=out is not None, QUANT=quant is not None, INV_MAX=inv_max, MIN_SCALE=min_scale, ROWS=per,
        BLOCK=block, num_warps=max(1, min(8, per * block // 256)), **pdl_kwargs(x2.device),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0, round_first: bool = True,
             triton_kernel: bool | None = None) -> torch.Tensor:  # fmt: skip
    """RMSNorm of x [..., n] over its last dim, scaled by weight [n], in one launch on CUDA.

    round_first (transformers' Llama and its copies): `weight * normed.to(x.dtype)`, whose dtype is
    weight's and x's promoted; else (Gemma with offset 1, Olmo2 with 0): `(normed * (offset + weight))`
    in float32, cast to x's dtype. normed = x / sqrt(mean(x^2) + eps) in float32. The torch path
    (CPU, autograd, other dtypes, rows over RMS_NORM_MAX) is transformers' own op sequence.
    """
    if not norm_kernel_ok(x, weight, triton_kernel):
        return rms_norm_torch(x, weight, eps, offset, round_first)
    out = torch.empty(x.shape, dtype=norm_out_dtype(x, weight, round_first), device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    norm_launch(x2 if x2.is_contiguous() else x2.contiguous(), weight, eps, out=out.view(x2.shape), offset=offset,
                round_first=round_first)  # fmt: skip
    return out


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, triton_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotate-half RoPE (`apply_rotary_pos_emb`) of q [1, Hq, W, D] and k [1, Hkv, W, D]
    (any strides with the last dim contiguous, e.g. a projection's [1, W, H, D] transposed) with cos,
    sin [1, W, D]: one launch on CUDA for both, rounded as torch's ops are. The outputs are laid out
    [1, W, H, D] in memory (as transformers' are), so the attention's [W, H, D] view needs no copy."""
    shapes_ok = q.dim() == k.dim() == 4 and q.shape[0] == 1 and cos.shape == sin.shape == (1, q.shape[2], q.shape[3])
    d = q.shape[-1]
    use = _use_triton(q, triton_kernel) and shapes_ok and q.dtype == k.dtype == cos.dtype == sin.dtype
    use = use and d >= 16 and d & (d - 1) == 0 and q.dtype in RMS_NORM_DTYPES  # a power-of-2 head
    if use:
        use = q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1 and cos.stride() == sin.stride()
    if not use or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return rope_qk_torch(q, k, cos, sin)
    hq, w, hkv = q.shape[1], q.shape[2], k.shape[1]
    q_out = torch.empty(1, w, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    k_out = torch.empty(1, w, hkv, d, dtype=k.dtype, device=k.device).transpose(1, 2)
    if w:
        hb = min(triton.next_power_of_2(hq + hkv), max(1, QK_BLOCK // d))
        _rope_qk_kernel[(w, triton.cdiv(hq + hkv, hb))](
            q, k, cos, sin, q_out, k_out, q.stride(1), q.stride(2), k.stride(1), k.stride(2), q_out.stride(1),
            q_out.stride(2), k_out.stride(1), k_out.stride(2), cos.stride(1), Q_HEADS=hq, HEADS=hq + hkv, D=d,
            HB=hb, num_warps=4, **pdl_kwargs(q.device),
        )  # fmt: skip
    return q_out, k_out


def qk_norm_rope(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    partner: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    eps: float,
    *,
    triton_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split QK-norm then RoPE for the q and k heads of qkv [W, (Hq + 2 Hkv) D].

    q_norm, k_norm: [2, D/2] (t-half weight, hw-half weight); cos, sin: [W, D] (sin signed for
    rotate-half); partner: int64 [D], each dim's rotate-half partner (torch path only; the kernel
    derives it). Returns q [W, Hq, D] and k [W, Hkv, D]. One launch on CUDA.
    """
    if not _use_triton(qkv, triton_kernel):
        return qk_norm_rope_torch(qkv, q_norm, k_norm, cos, sin, partner, q_heads, kv_heads, eps)
    w, d = qkv.shape[0], q_norm.shape[-1] * 2
    q = torch.empty(w, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(w, kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    heads = q_heads + kv_heads
    args = (qkv, q_norm, k_norm, cos.contiguous(), sin.contiguous(), q, k, qkv.stride(0), eps)
    if w * heads <= QK_FEW_PROGRAMS:  # few rows: one head on one warp per program, every SM busy
        _qk_norm_rope_kernel[(w, heads)](*args, Q_HEADS=q_heads, HEADS=heads, D=d, num_warps=1,
                                         **pdl_kwargs(qkv.device))  # fmt: skip
    else:  # many: a block of heads on 4 warps (at 768 rows 16 against 41 us on the H200)
        hb = min(triton.next_power_of_2(heads), max(1, QK_BLOCK // d))
        _qk_norm_rope_block_kernel[(w, triton.cdiv(heads, hb))](
            *args, Q_HEADS=q_heads, HEADS=heads, D=d, HB=hb, num_warps=4, **pdl_kwargs(qkv.device)
        )
    return q, k


def silu_mul(gate_up: torch.Tensor, *, triton_kernel: bool | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [W, 2I]; returns [W, I]. One launch on CUDA."""
    if not _use_triton(gate_up, triton_kernel):
        return silu_mul_torch(gate_up)
    w, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(w, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(w, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4, **pdl_kwargs(out.device))
    return out
