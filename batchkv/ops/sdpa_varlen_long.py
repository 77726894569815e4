"""Device code of `sdpa_varlen`'s long path: prefill chunks (q_len > Q_SHORT), no split.

`long_kernel`, grid (query blocks bound, Hkv): one program per BLOCK_Q queries of a long segment
and one KV head, over the keys its rows attend, written straight to `out`. The (query, group
head) pairs fill the tile's BLOCK_M rows, so K and V are read once per GQA group. Later query
blocks of a segment (more keys, causally) get the lower program ids, so they start first.

Keys [k0, k1) are walked in three loops: a masked head (window or ring edge), unmasked interior
blocks that every row attends whole, and a masked tail up to the causal diagonal of the tile's
last query; k1 stops at that diagonal. Each loop is software-pipelined on its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.kv_write_triton import E4M3_FLOOR
from batchkv.ops.sdpa_varlen_common import (
    NEG_INF,
    P_SHIFT,
    full_bounds,
    q_for_dots,
    quantize_rows,
    ring_rows,
    row_bounds,
)


@triton.jit
def _locate_combine(a0, a1, b0, b1):
    return a0 + b0, tl.maximum(a1, b1)


@triton.jit
def _load_keys(ptrs, ok, BOUNDED: tl.constexpr):
    """tl.load(ptrs), 0 where not ok (a mask broadcast to ptrs' shape) when BOUNDED."""
    return tl.load(ptrs, mask=ok, other=0.0) if BOUNDED else tl.load(ptrs)


@triton.jit
def _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k_ring, start0, stop, k1,
                  row_lo, row_hi, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
                  QK_E4M3: tl.constexpr):  # fmt: skip
    """Online softmax over key blocks [start0, stop) (keys < k1), continuing (m_i, l_i, acc).

    QUANT: e4m3 codes convert to q's dtype; one [BLOCK_N] K scale vector scales the score columns
    and one V scale vector scales p before the PV dot (see `sdpa_varlen_kernels`). QK_E4M3: q_tile
    holds e4m3 codes and qk_scale is [BLOCK_M] (each row's q scale times the softmax scale): QK^T is
    an e4m3 dot of q's codes and K's codes as loaded, V converts to fp16 for the PV dot."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    for start in range(start0, stop, BLOCK_N):
        t = start + offs_n  # key positions
        rr = ring_rows(t, k_ring, rows).to(tl.int64)
        r = rr[:, None] * stride_r + d[None, :]
        in_range = (t < k1)[:, None]  # all true in interior blocks; cheap, and keeps one load path
        if QK_E4M3:  # fp32 accumulation of exact e4m3 products, then the column scales; interiors unmasked
            k = _load_keys(k_base + r, in_range, MASKED)
            k_s = _load_keys(ks_base + rr * stride_sr, t < k1, MASKED)
            s = tl.dot(q_tile, tl.trans(k), out_dtype=tl.float32) * k_s[None, :]  # log2 units / qk_scale rows
        elif QUANT:
            k = tl.load(k_base + r, mask=in_range, other=0.0)
            k_s = tl.load(ks_base + rr[None, :] * stride_sr, mask=(t < k1)[None, :], other=0.0) * qk_scale
            s = tl.dot(q_tile, tl.trans(k.to(q_tile.dtype)), input_precision=DOT_PREC) * k_s  # [M, N], log2 units
        else:
            k = tl.load(k_base + r, mask=in_range, other=0.0)
            s = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
        if MASKED:
            s = tl.where((t[None, :] >= row_lo[:, None]) & (t[None, :] < row_hi[:, None]), s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays at exp2(-inf) = 0
        if QK_E4M3:  # s and m are scores / qk_scale (> 0): the row scale rides in exp2's argument, one FFMA
            alpha = tl.exp2((m_i - m_safe) * qk_scale)
            p = tl.exp2(s * qk_scale[:, None] - (m_safe * qk_scale - P_SHIFT)[:, None])
        else:
            alpha = tl.exp2(m_i - m_safe)
            if QUANT:  # p times 2^P_SHIFT, l_i with it (acc / l_i is unchanged): p * v_scale stays normal in fp16
                m_safe -= P_SHIFT
            p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QK_E4M3:
            p = p * _load_keys(vs_base + rr * stride_sr, t < k1, MASKED)[None, :]
            v = _load_keys(v_base + r, in_range, MASKED).to(tl.float16)
        elif QUANT:
            p = p * tl.load(vs_base + rr[None, :] * stride_sr, mask=(t < k1)[None, :], other=0.0)
            v = tl.load(v_base + r, mask=in_range, other=0.0).to(q_tile.dtype)
        else:
            v = tl.load(v_base + r, mask=in_range, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def long_kernel(q, k_store, v_store, k_scale, v_scale, info, out, S, T, rows, window, qk_scale,
                stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh, stride_ot,
                stride_oh, QUANT: tl.constexpr, QK_E4M3: tl.constexpr, HW_CAST: tl.constexpr, CAUSAL: tl.constexpr,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr, S_POW2: tl.constexpr,
                DOT_PREC: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1)
    idx = tl.arange(0, S_POW2)
    q_len_v = tl.load(info + idx * 4 + 1, mask=idx < S, other=0)
    nlb = tl.where(q_len_v > Q_SHORT, (q_len_v + BLOCK_Q - 1) // BLOCK_Q, 0)  # query blocks of long segments
    ends = tl.cumsum(nlb, 0)
    before = ends <= pid
    s, first = tl.reduce((before.to(tl.int32), tl.where(before, ends, 0)), 0, _locate_combine)
    if s >= S:
        return  # past the last long query block
    q_start = tl.load(info + s * 4)
    q_len = tl.load(info + s * 4 + 1)
    col = tl.load(info + s * 4 + 2).to(tl.int64)
    kv_end = tl.load(info + s * 4 + 3)
    qb = (q_len + BLOCK_Q - 1) // BLOCK_Q - 1 - (pid - first)  # last query block first
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    i = qb * BLOCK_Q + r // GROUP
    token = q_start + i
    row_ok = (r < BLOCK_Q * GROUP) & (i < q_len) & (token >= 0) & (token < T)
    head = h * GROUP + r % GROUP
    q_ptrs = q + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if QK_E4M3:  # codes and one scale per (query, head) row; the softmax scale folds into the row scales
        q_tile, q_scale = quantize_rows(q_tile, HW_CAST)
        qk_scale = q_scale * qk_scale  # a zero row's scale times a tiny softmax scale stays a normal float
        qk_scale = tl.where(qk_scale < E4M3_FLOOR, E4M3_FLOOR, qk_scale)  # (2^-126): no -inf * 0; NaN stays NaN
    else:
        q_tile = q_for_dots(q_tile, k_store.dtype.element_ty, QUANT)
    row_lo, row_hi = row_bounds(kv_end - q_len + i, row_ok, kv_end, rows, window, CAUSAL)
    k0 = tl.min(tl.where(row_ok, row_lo, kv_end), 0)
    k1 = tl.max(tl.where(row_ok, row_hi, 0), 0)  # the tile's last query: the causal diagonal
    i_last = tl.minimum(q_len, qb * BLOCK_Q + BLOCK_Q) - 1
    full_lo, full_hi = full_bounds(q_len, kv_end, rows, window, qb * BLOCK_Q, i_last, CAUSAL)
    a = tl.minimum(k0 + (tl.maximum(full_lo - k0, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, k1)  # interior start
    b = tl.maximum(a + tl.maximum(tl.minimum(full_hi, k1) - a, 0) // BLOCK_N * BLOCK_N, a)  # interior end
    base = col * stride_c + h * stride_h
    k_base, v_base = k_store + base, v_store + base
    sc = col * stride_sc + h.to(tl.int64) * stride_sh  # this (column, KV head)'s scales
    ks_base, vs_base = k_scale + sc, v_scale + sc
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, k0, a, k1,
                                  row_lo, row_hi, m_i, l_i, acc, qk_scale, True, BLOCK_N, HEAD_DIM, DOT_PREC,
                                  QUANT, QK_E4M3)  # fmt: skip
    m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, a, b, k1,
                                  row_lo, row_hi, m_i, l_i, acc, qk_scale, False, BLOCK_N, HEAD_DIM, DOT_PREC,
                                  QUANT, QK_E4M3)  # fmt: skip
    m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, b, k1, k1,
                                  row_lo, row_hi, m_i, l_i, acc, qk_scale, True, BLOCK_N, HEAD_DIM, DOT_PREC,
                                  QUANT, QK_E4M3)  # fmt: skip
    o = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    ptrs = out + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])
