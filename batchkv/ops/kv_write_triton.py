"""kv_write: the step's K and V rows into the column store, both in one Triton launch.

`k_flat[slots[i]] = k[i]` and `v_flat[slots[i]] = v[i]`, cast to the store dtype; the same contract
as `kv_write_reference`. One program per token copies its [Hkv, D] rows of K and of V, 16-byte
vectorised along D. Slots are int64 and offsets are computed in int64 (rows * C * Hkv * D can pass
2^31). Padding tokens carry slots in the scratch column, so every slot is written and none is read
by attention. Capturable: no host reads, grid = (W,).

e4m3 stores quantise in the same launch: each (token, KV head) row of D gets scale
max(amax / 448, 2^-126) (IEEE divisions, `div_rn`) and codes e4m3(x / scale), bit for bit what
`quantize_fp8` stores. The rounding to e4m3 is done in fp32 first (`round_e4m3`), so the cast
only moves exact values: Triton's interpreter rounds fp32 -> e4m3 half-up and drops the carry into
the exponent (1.97 becomes 1.0), and the explicit rounding makes CPU runs store what the GPU
stores. A row holding a NaN or an infinity stores a NaN scale and every code 0x7F (e4m3fn's NaN), as
`quantize_fp8` does, so it reads back NaN on every device: the codes are set as bits, since the
interpreter's cast turns NaN into a finite code and decodes 0x7F as 480 (the NaN scale still poisons
it there). Scale planes are [rows, C, Hkv] with any strides (the store's are rows last): slot s's
scales sit at (s // C, s % C), one int64 division per program.

With `rope` (`launch_kv_write`, which `sdpa_varlen(rope=)` launches) the same program first rotates its
token's K rows and its [Hq, D] query rows by the step's cos and sin (`batchkv.ops.rope`), storing K so
and q into a new tensor: a transformers model's RoPE and the write, one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchkv.errors import ContractError
from batchkv.ops.pdl import pdl_enter, pdl_kwargs
from batchkv.ops.support import COMPUTE_DTYPES, FP8_MAX, SCALE_FLOOR, quantized, refusal, scales_refusal

E4M3_MAX = tl.constexpr(FP8_MAX)
E4M3_FLOOR = tl.constexpr(SCALE_FLOOR)
E4M3_NAN = tl.constexpr(0x7F)  # e4m3fn's NaN code, sign bit clear (the one torch's cast gives)


@triton.jit
def round_e4m3(y):
    """fp32 y (|y| <= 448) rounded to nearest-even on the e4m3 grid, still fp32.

    The grid step below 2^(e+1) is 2^(max(e, -6) - 3) (3 mantissa bits; subnormals under 2^-6).
    Adding c = 2^23 steps makes the fp32 sum's ulp one step, so (|y| + c) - c rounds |y| to the
    grid, ties to even, in IEEE arithmetic; the sign comes back from y's sign bit (-0 stays -0).
    """
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127  # unbiased exponent; -127 for zero
    step = tl.maximum(e, -6) - 3  # log2 of the grid step
    c = ((step + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + c) - c
    return tl.where(bits < 0, -r, r)


@triton.jit
def _store_rows(flat, scale, x, dst, ok, s_dst, s_ok, QUANT: tl.constexpr):
    """Store rows x [H, D] at `flat + dst`; e4m3 stores also get one scale per row, at `scale + s_dst` [H]."""
    if QUANT:
        x = x.to(tl.float32)
        s = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), E4M3_MAX), E4M3_FLOOR)  # [H]; tl.max skips a NaN
        # A row holding a NaN or an infinity (|x| < inf is false for both) reads back NaN: NaN scale, every
        # code 0x7F. The codes are set as bits: the interpreter's cast turns NaN into a finite code (0x7C).
        bad = tl.min((tl.abs(x) < float("inf")).to(tl.int32), 1) == 0  # [H]
        s = tl.where(bad, float("nan"), s)
        y = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -E4M3_MAX), E4M3_MAX)
        codes = round_e4m3(y).to(flat.dtype.element_ty).to(tl.uint8, bitcast=True)
        codes = tl.where(bad[:, None], E4M3_NAN, codes).to(tl.uint8)
        tl.store(flat + dst, codes.to(flat.dtype.element_ty, bitcast=True), mask=ok)
        tl.store(scale + s_dst, s, mask=s_ok)
    else:
        tl.store(flat + dst, x.to(flat.dtype.element_ty), mask=ok)


@triton.jit
def rope_partner(d, DIM: tl.constexpr):
    """(partner column, sign) of columns d < DIM in rotate_half: x[d + DIM/2] negated in the first half."""
    return (d + DIM // 2) % DIM, tl.where(d < DIM // 2, -1.0, 1.0)


@triton.jit
def rotate_half_rope(x, xp, cos, sin, sign, dtype: tl.constexpr):
    """x * cos + sign * xp * sin with fp32 cos, sin: each product and the sum rounded to `dtype`, as
    torch's three ops round them (`batchkv.ops.rope.rope_rows`)."""
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (sign * xp.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _kv_write_kernel(k_flat, v_flat, k, v, slots, k_scale, v_scale, columns, stride_fs, stride_fh, stride_ks,
                     stride_kh, stride_vs, stride_vh, stride_sr, stride_sc, stride_sh, stride_vfs, stride_vfh,
                     q, q_out, cos, sin, stride_qt, stride_qh, stride_cos,
                     HKV: tl.constexpr, H_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, K_DIM: tl.constexpr,
                     V_TILE: tl.constexpr, V_DIM: tl.constexpr, QUANT: tl.constexpr, ROPE: tl.constexpr,
                     HQ: tl.constexpr, HQ_POW2: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    pdl_enter(GDC)  # launched early on sm_90: wait for the grids before (k, v), then let the next launch start
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    h = tl.arange(0, H_POW2)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]  # key columns (a power of two; those past K_DIM masked)
    dv = tl.arange(0, V_TILE)[None, :]  # value columns
    k_ok = (h < HKV) & (d < K_DIM) if K_DIM < HEAD_DIM else h < HKV  # (equal widths: the code before them)
    v_ok = (h < HKV) & (dv < V_DIM) if V_DIM < V_TILE else h < HKV
    heads = tl.arange(0, H_POW2)
    s_dst = 0
    if QUANT:  # k_scale and v_scale share their strides: [rows, C, Hkv], slot = row * C + col
        r = slot // columns
        s_dst = r * stride_sr + (slot - r * columns) * stride_sc + heads * stride_sh
    row = i.to(tl.int64)
    k_row = tl.load(k + row * stride_ks + h * stride_kh + d, mask=k_ok, other=0.0)  # padding: zeros (no amax)
    if ROPE:  # k rotated on its way in, q into q_out [W, HQ, K_DIM] (`batchkv.ops.rope`)
        partner, sign = rope_partner(d, K_DIM)
        c = tl.load(cos + row * stride_cos + d, mask=d < K_DIM, other=0.0).to(tl.float32)
        s = tl.load(sin + row * stride_cos + d, mask=d < K_DIM, other=0.0).to(tl.float32)
        k_pair = tl.load(k + row * stride_ks + h * stride_kh + partner, mask=k_ok, other=0.0)
        k_row = rotate_half_rope(k_row, k_pair, c, s, sign, k_row.dtype)
        hq = tl.arange(0, HQ_POW2)[:, None]
        q_ok = (hq < HQ) & (d < K_DIM)
        q_at = q + row * stride_qt + hq * stride_qh
        x = tl.load(q_at + d, mask=q_ok, other=0.0)
        x_pair = tl.load(q_at + partner, mask=q_ok, other=0.0)
        q_rot = rotate_half_rope(x, x_pair, c, s, sign, q_out.dtype.element_ty)
        tl.store(q_out + (row * HQ + hq) * K_DIM + d, q_rot, mask=q_ok)
    v_row = tl.load(v + row * stride_vs + h * stride_vh + dv, mask=v_ok, other=0.0)
    _store_rows(k_flat, k_scale, k_row, slot * stride_fs + h * stride_fh + d, k_ok, s_dst, heads < HKV, QUANT)
    _store_rows(v_flat, v_scale, v_row, slot * stride_vfs + h * stride_vfh + dv, v_ok, s_dst, heads < HKV, QUANT)


def _scales_problem(k_flat: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str | None:
    """Why k_scale, v_scale are not the scale planes [rows, C, Hkv] of `k_flat` [rows * C, Hkv, D]."""
    shape = tuple(k_scale.shape) if k_scale is not None else ()
    slots, num_kv_heads = k_flat.shape[:2]
    if quantized(k_flat.dtype) and (k_scale is None or len(shape) != 3 or shape[0] * shape[1] != slots):
        got = "None" if k_scale is None else list(shape)
        return f"k_scale, v_scale must be [rows, C, {num_kv_heads}] with rows * C = {slots} store slots; got {got}"
    return scales_refusal(k_flat.dtype, k_flat.device, (*shape[:2], num_kv_heads), k_scale, v_scale)


def check_kv_write(
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raise ContractError unless `kv_write` takes these arguments (its docstring says what it takes)."""
    if k_flat.dim() != 3 or v_flat.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ContractError(
            f"kv_write wants k_flat [N, Hkv, D], v_flat [N, Hkv, Dv], k [W, Hkv, D] and v [W, Hkv, Dv]; got "
            f"{tuple(k_flat.shape)}, {tuple(v_flat.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    width, _, head_dim = k.shape
    problem = refusal(k_flat.dtype, head_dim, device=k_flat.device, value_dim=v.shape[2])
    if problem:
        raise ContractError(f"kv_write: {problem}")
    if k_flat.shape[1:] != k.shape[1:] or v_flat.shape[1:] != v.shape[1:] or k_flat.shape[:2] != v_flat.shape[:2]:
        raise ContractError(
            f"store rows {tuple(k_flat.shape)}, {tuple(v_flat.shape)} and k, v rows {tuple(k.shape)}, "
            f"{tuple(v.shape)} must match (N and Hkv the same, each width its own)"
        )
    if v.shape[0] != width or slots.dtype not in (torch.int64, torch.int32) or slots.shape != (width,):
        raise ContractError(f"slots must be int64 or int32 [{width}]; got {slots.dtype} {tuple(slots.shape)}")
    if not k_flat.device == v_flat.device == k.device == v.device == slots.device:
        raise ContractError("k_flat, v_flat, k, v and slots must share a device")
    if k_flat.dtype != v_flat.dtype or {k.dtype, v.dtype} - set(COMPUTE_DTYPES):
        raise ContractError(
            f"stores must share a dtype, k and v be fp16/bf16/fp32; got {k_flat.dtype}/{v_flat.dtype}, "
            f"{k.dtype}/{v.dtype}"
        )
    problem = _scales_problem(k_flat, k_scale, v_scale)
    if problem:
        raise ContractError(f"kv_write: {problem}")
    if any(x.stride(-1) != 1 for x in (k_flat, v_flat, k, v)) or slots.stride(0) != 1:
        raise ContractError("k_flat, v_flat, k, v need a contiguous last dim and slots stride 1; call .contiguous()")


def kv_write(
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write this step's K/V rows at their store slots, one launch for both.

    k_flat, v_flat: [rows * C, Hkv, D] and [rows * C, Hkv, Dv] views of the stores (one dtype, last
    dim contiguous); k, v: [W, Hkv, D] and [W, Hkv, Dv] fp16/bf16/fp32 (cast on write); slots: int64
    (or int32) [W] on the same device. D and Dv multiples of 16 from 16 to 256 (`refusal`). e4m3
    stores (`torch.float8_e4m3fn`) need
    k_scale, v_scale: fp32 scale planes [rows, C, Hkv] (one set of strides, any; slot s's scales
    are [s // C, s % C]), and get codes and scales as `quantize_fp8` makes them (a row holding a NaN
    or an infinity: NaN scale, codes 0x7F, read back as NaN). Capturable (no host reads). On sm_90+
    a programmatic dependent launch (`ops/pdl.py`).

    >>> views = cache._store.write_views(0)  # k, v [rows * C, 8, 128] (+ k_scale, v_scale [rows, C, 8])
    >>> kv_write(views["k"], views["v"], k, v, slots, views.get("k_scale"), views.get("v_scale"))  # k, v [W, 8, 128]
    """
    check_kv_write(k_flat, v_flat, k, v, slots, k_scale, v_scale)
    launch_kv_write(k_flat, v_flat, k, v, slots, k_scale, v_scale)


def launch_kv_write(
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """`kv_write` on arguments `check_kv_write` has passed (the launch alone). rope: (q [W, Hq, D], cos,
    sin [W, D]) that `rope_problem` passed, k unrotated: k and q are rotated in the launch (k stored so,
    q into the returned new [W, Hq, D]); None: k as it is, and None returned."""
    width, num_kv_heads, head_dim = k.shape
    quant = quantized(k_flat.dtype)
    q, cos, sin = rope if rope is not None else (k, k, k)  # unread without ROPE
    q_out = None if rope is None else torch.empty(width, q.shape[1], head_dim, dtype=q.dtype, device=q.device)
    if width == 0:
        return q_out
    k_scale, v_scale = (k_scale, v_scale) if quant else (k_flat, v_flat)  # unread without QUANT
    scale_strides = k_scale.stride() if quant else (0, 0, 0)
    value_dim = v.shape[2]
    _kv_write_kernel[(width,)](
        k_flat, v_flat, k, v, slots, k_scale, v_scale, k_scale.shape[1] if quant else 1, k_flat.stride(0),
        k_flat.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *scale_strides, v_flat.stride(0),
        v_flat.stride(1), q, k if q_out is None else q_out, cos, sin, q.stride(0), q.stride(1), cos.stride(0),
        HKV=num_kv_heads, H_POW2=triton.next_power_of_2(num_kv_heads), HEAD_DIM=triton.next_power_of_2(head_dim),
        K_DIM=head_dim, V_TILE=triton.next_power_of_2(value_dim), V_DIM=value_dim, QUANT=quant, ROPE=rope is not None,
        HQ=q.shape[1], HQ_POW2=triton.next_power_of_2(q.shape[1]), num_warps=4, **pdl_kwargs(k.device),
    )  # fmt: skip
    return q_out
