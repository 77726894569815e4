"""Device helpers shared by `sdpa_varlen`'s kernels: the table, key ranges, row bounds.

`seq_info` rows are (q_start, q_len, col, kv_end). Query i of a segment sits at position
`p_i = kv_end - q_len + i`; only keys t >= kv_end - rows are resident; causal rows attend
[lo_i, p_i], non-causal rows [lo, kv_end), a window trimming lo. Positions are int32 (a kv_end
past 2^31 is outside the contract); store offsets are int64. Scores are in log2 units (1/ln2 is
folded into qk_scale), so softmax uses exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.kv_write_triton import E4M3_FLOOR, E4M3_MAX, round_e4m3

NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2)
# e4m3: p * v_scale enters the PV dot in fp16, whose normals start at 2^-14. The tile loops take p
# 2^P_SHIFT times larger (exp2 of the scores minus (row max - P_SHIFT): no instruction per element;
# l_i and acc both carry the factor, so acc / l_i is unchanged and lse subtracts P_SHIFT), so
# p * v_scale stays normal down to p * amax = 1.1e-4 (unshifted: 0.027, where the other keys of a
# head dominated by one sink key sit) and finite below amax = 448 * 65504 / 2^P_SHIFT = 1.1e5.
P_SHIFT = tl.constexpr(8.0)
# $2: two int16, each two adjacent e4m3 codes (even column in the low byte); $0, $1: f16x2 of the two
# low bytes (even columns) and of the two high bytes (odd columns). One PRMT gathers the bytes.
PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 u; .reg .b16 lo, hi; prmt.b32 u, $2, 0, 0x3120; mov.b32 {lo, hi}, u; "
    "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
# $1: an address, $2: nonzero to fetch; $0 is a dummy result (inline asm needs one)
PREFETCH_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.jit
def load_table(info, S, S_POW2: tl.constexpr, start=0):
    """`seq_info` rows [start, start + S_POW2) as four [S_POW2] columns (zeros from row S on), from one
    [S_POW2, 4] load of 16-byte rows."""
    idx = start + tl.arange(0, S_POW2)
    c = tl.arange(0, 4)[None, :]
    tab = tl.load(info + idx[:, None] * 4 + c, mask=(idx < S)[:, None], other=0)
    q_start = tl.sum(tl.where(c == 0, tab, 0), 1)  # the 4 columns sit in one thread: no shuffles
    q_len = tl.sum(tl.where(c == 1, tab, 0), 1)
    col = tl.sum(tl.where(c == 2, tab, 0), 1)
    kv_end = tl.sum(tl.where(c == 3, tab, 0), 1)
    return idx, q_start, q_len, col, kv_end


# one MUFU.TANH per element (sm_75+): max relative error 2^-10.99, so a capped score moves by at most
# ~5e-4 of itself, below bf16's rounding of the scores' own inputs
TANH_ASM = tl.constexpr("tanh.approx.f32 $0, $1;")
SOFTCAP_EXACT = 1  # the kernels' SOFTCAP switch: 0 none, 1 exact (exp2 and a division), 2 the hardware tanh
SOFTCAP_APPROX = 2


@triton.jit
def tanh_capped(x, MODE: tl.constexpr = 1):
    """tanh(x), x a score over the cap (the scales folded by the caller). MODE 1 (exact; the
    interpreter, fp32 queries): tanh(x) = 1 - 2 / (e^2x + 1), one exp2 and one division, exact limits
    (+-1 where e^2x overflows or vanishes), an absolute error of ~1e-7 near 0. MODE 2 (NVIDIA, 16-bit
    queries): the hardware's `tanh.approx.f32`, one special-function op instead of an exp2, a
    reciprocal and its refinement; relative error <= 2^-10.99. NaN stays NaN either way."""
    if MODE == 2:
        return tl.inline_asm_elementwise(TANH_ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    e = tl.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def soft_cap(s, cap2, MODE: tl.constexpr = 1):
    """cap2 * tanh(s / cap2): a score s in log2 units (softmax scale and 1/ln2 folded in) capped as
    Gemma2 caps its scaled scores, cap2 the cap times 1/ln2, so the result stays in log2 units
    (`tanh_capped` says how, per MODE)."""
    return cap2 * tanh_capped(s * (1.0 / cap2), MODE)


@triton.jit
def sink_logit(sinks, head, ok):
    """`sinks[head]` (natural units, any float dtype) in log2 units, 0 where not ok: loaded apart from
    `sink_share` so a kernel can issue the load early and keep its latency off the row's tail."""
    return tl.load(sinks + head, mask=ok, other=0.0).to(tl.float32) * LOG2E


@triton.jit
def sink_share(lse, sink):
    """The factor 1 / (1 + 2^(sink - lse)) that turns a row's output normalised over its keys into one
    normalised over its keys and its sink logit (`sink_logit`): lse is the row's log2-sum-exp over
    every key. A row without keys (lse = -inf) gets 0."""
    return 1.0 / (1.0 + tl.exp2(sink - lse))


@triton.jit
def sink_weight(lse, sinks, head, ok):
    """`sink_share` of a row's lse and its query head's sink logit, `sinks[head]` loaded here."""
    return sink_share(lse, sink_logit(sinks, head, ok))


@triton.jit
def first_key(q_len, kv_end, rows, window, CAUSAL: tl.constexpr):
    """First key any query of a segment attends (vectors or scalars alike)."""
    lo = tl.maximum(kv_end - rows, 0)  # oldest resident key
    if CAUSAL:
        return tl.where(window > 0, tl.maximum(lo, kv_end - q_len - window + 1), lo)  # first query's window
    return tl.where(window > 0, tl.maximum(lo, kv_end - window), lo)


@triton.jit
def row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL: tl.constexpr):
    """Keys each row attends, [row_lo, row_hi) (empty for padding rows); pos: query positions."""
    lo = tl.maximum(kv_end - rows, 0)
    if CAUSAL:
        row_lo = tl.where(window > 0, tl.maximum(lo, pos - window + 1), lo)
        row_hi = pos + 1
    else:
        row_lo = tl.where(window > 0, tl.maximum(lo, kv_end - window), lo) + 0 * pos
        row_hi = kv_end + 0 * pos
    return row_lo, tl.where(row_ok, row_hi, row_lo)


@triton.jit
def full_bounds(q_len, kv_end, rows, window, i_first, i_last, CAUSAL: tl.constexpr):
    """[full_lo, full_hi): keys that every query i_first..i_last of a segment attends (scalars).

    A key block inside it needs no mask; rows outside the tile only make it narrower (safe)."""
    lo = tl.maximum(kv_end - rows, 0)
    if CAUSAL:
        full_lo = tl.where(window > 0, tl.maximum(lo, kv_end - q_len + i_last - window + 1), lo)
        full_hi = kv_end - q_len + i_first + 1
    else:
        full_lo = tl.where(window > 0, tl.maximum(lo, kv_end - window), lo)
        full_hi = kv_end
    return full_lo, full_hi


@triton.jit
def q_for_dots(q_tile, store_ty: tl.constexpr, QUANT: tl.constexpr):
    """q in the dtype the dots run in: the store's, or for e4m3 stores fp16 (codes convert to fp16 in
    one instruction per pair, to bf16 in three), fp32 queries staying fp32."""
    if not QUANT:
        q_tile = q_tile.to(store_ty)
    elif q_tile.dtype != tl.float32:
        q_tile = q_tile.to(tl.float16)
    return q_tile


@triton.jit
def quantize_rows(x, HW_CAST: tl.constexpr):
    """x [R, D] -> (e4m3 codes [R, D], fp32 scales [R]), `code * scale` ~ x: the write's scale per row,
    max(amax / 448, 2^-126), and codes e4m3(x * (1 / scale)) rounded to nearest even, as
    `quantize_queries` makes them. One IEEE division per row and a multiply per element (the write
    divides each element; x * (1 / scale) moves a code only at a near-tie), no clamp: |x / scale|
    <= 448 (1 + 2^-22) rounds to 448. HW_CAST: the cast rounds to nearest even (sm_89+'s cvt.rn);
    else (the interpreter, whose cast rounds half up) `round_e4m3` first. A row holding a NaN gets a
    NaN scale (tl.max skips NaN), so its scores are NaN as unrounded queries' are, on either path."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), E4M3_MAX), E4M3_FLOOR)
    scale = tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), scale)
    y = x * tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    if not HW_CAST:
        y = round_e4m3(y)
    return y.to(tl.float8e4nv), scale


@triton.jit
def unpack_pairs(x, dtype: tl.constexpr, CVT_ASM: tl.constexpr):
    """int16 x, each element two adjacent e4m3 codes (little-endian: the even column's in the low
    byte), as (even columns, odd columns) converted exactly to `dtype` (fp16 or fp32), x's shape.

    Why pairs: an e4m3 [N, D] tile is 8-bit, and sm_90's ldmatrix transposes only 16-bit elements,
    so Triton fed V (contracted over keys) to the dot one byte at a time (128 LDS.U8 per thread
    per 128-key tile) and K in a layout that kept q in shared memory. Read as int16 [N, D / 2],
    both are 16-bit tiles; a dot over D becomes two dots over the even and odd columns, a dot of
    p with V two dots giving the even and odd output columns. CVT_ASM (sm_89+): one PRMT and two
    cvt.rn.f16x2.e4m3x2 per two elements; else (the interpreter) Triton's own conversions."""
    if CVT_ASM:
        even, odd = tl.inline_asm_elementwise(PAIRS_ASM, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                              is_pure=True, pack=2)  # fmt: skip
    else:
        even = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = ((x >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even.to(dtype), odd.to(dtype)


@triton.jit
def ring_rows(t, k0, rows):
    """Storage row t % rows of keys t in [k0, k0 + rows) without a division per key: the range
    wraps at most once (a scalar base and one compare)."""
    base = (k0 // rows) * rows
    return t - base - tl.where(t >= base + rows, rows, 0)


@triton.jit
def prefetch_keys(k_base, v_base, stride_r, stride_h, rows, k_ring, a, b, BLOCK_N: tl.constexpr,
                  HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SECTOR: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    """Ask the L2 for the K and V rows of keys [a, b) (at most BLOCK_N; HEADS heads of HEAD_DIM
    elements from k_base, v_base; ring rows relative to k_ring, as in `ring_rows`) and return at
    once: one `prefetch.global.L2` per 32-byte sector (SECTOR elements), so the loads that follow find
    the L2 already filling and HBM streams before the loop asks. (sm_90's bulk prefetch would take
    one instruction per row, but its address is warp-uniform: per-lane rows become a loop.)

    Returns 0.0, or with CHECK (the interpreter, which runs no PTX) 0 * each sector's first element:
    NaN when a row outside the resident keys was named, so the NaN-poisoned tests see it."""
    SECTORS: tl.constexpr = (HEAD_DIM + SECTOR - 1) // SECTOR  # per row and head
    t = a + tl.arange(0, BLOCK_N)[:, None]  # [N, 1] keys
    c = tl.arange(0, HEADS * SECTORS)[None, :]  # (head, sector)
    off = ring_rows(t, k_ring, rows).to(tl.int64) * stride_r + (c // SECTORS) * stride_h + (c % SECTORS) * SECTOR
    want = (t < b) & (c < HEADS * SECTORS)  # [N, HEADS * SECTORS]
    if CHECK:
        first = tl.load(k_base + off, mask=want, other=0.0).to(tl.float32)
        first += tl.load(v_base + off, mask=want, other=0.0).to(tl.float32)
        trip = tl.sum(tl.sum(first * 0.0, 1), 0)
    else:
        flag = want.to(tl.int32)
        tl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r", [k_base + off, flag], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r", [v_base + off, flag], dtype=tl.int32, is_pure=False, pack=1)
        trip = 0.0
    return trip
