"""Device code of `sdpa_varlen`'s long path: prefill chunks (q_len > Q_SHORT), no split.

`long_kernel`, grid (query blocks bound * Hkv,): one program per BLOCK_Q queries of a long segment
and one KV head, over the keys its rows attend, written straight to `out`. The (query, group
head) pairs fill the tile's BLOCK_M rows, so K and V are read once per GQA group. Program ids run
over the KV heads first, then the query blocks, later blocks of a segment (more keys, causally)
first: the longest programs of every head start in the first wave, and the ids past the last long
block (the grid's bound is static) come last, where they exit while the final wave runs.

Keys [k0, k1) are walked in three loops: a masked head (window or ring edge), unmasked interior
blocks that every row attends whole, and a masked tail up to the causal diagonal of the tile's
last query; k1 stops at that diagonal. Each loop is software-pipelined on its own.

TMA (`SdpaConfig.tma_long`, sm_90+): the interior's K and V tiles come by tensor-memory-access
copies through two host descriptors over the stores viewed [R, C * Hkv * D] (whole contiguous key
rows, `tma_views`), a block one box of BLOCK_N rows and D columns, instead of per-thread
addresses; an interior that wraps the ring (its two ends on different laps) takes pointer loads.
Soft-capping (SOFTCAP) caps each score in `_update`; it runs with exact queries only (the launcher
turns QK_E4M3 off for it). A sink (SINKS) rescales each row's output once, by `sink_weight`.

Masked blocks always take pointer loads: a box brings the rows past k1 too, and their contents
(NaN in the tests' poisoned stores) would reach the PV dot through p = 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.kv_write_triton import E4M3_FLOOR
from batchkv.ops.pdl import pdl_enter
from batchkv.ops.sdpa.common import (
    NEG_INF,
    P_SHIFT,
    full_bounds,
    q_for_dots,
    quantize_rows,
    ring_rows,
    row_bounds,
    sink_weight,
    tanh_capped,
)


@triton.jit
def _locate_combine(a0, a1, b0, b1):
    return a0 + b0, tl.maximum(a1, b1)


@triton.jit
def _load_keys(ptrs, ok, BOUNDED: tl.constexpr):
    """tl.load(ptrs), 0 where not ok (a mask broadcast to ptrs' shape) when BOUNDED."""
    return tl.load(ptrs, mask=ok, other=0.0) if BOUNDED else tl.load(ptrs)


@triton.jit
def _tile(base, desc, scale_base, stride_r, stride_sr, rows, k_ring, start, k1, row0, col0, MASKED: tl.constexpr,
          BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, TMA: tl.constexpr,
          DIM: tl.constexpr):  # fmt: skip
    """The K or V tile [BLOCK_N, HEAD_DIM] of key block `start` as stored (codes for e4m3) and its scales
    [BLOCK_N] (QUANT; else ones, unused): DIM columns of the store, those past it 0 (a width that is
    not a power of two). MASKED: keys >= k1 read as 0 (scales too). TMA (unmasked blocks of one lap;
    DIM == HEAD_DIM): the tile is the box of `desc` at row row0 + (start - the lap's first key),
    column col0; else per-thread loads from `base`, ring rows relative to k_ring."""
    t = start + tl.arange(0, BLOCK_N)  # key positions
    rr = ring_rows(t, k_ring, rows).to(tl.int64)
    if TMA:
        x = desc.load([row0 + (start - (k_ring // rows) * rows), col0])
    elif DIM < HEAD_DIM:
        c = tl.arange(0, HEAD_DIM)[None, :]
        ok = c < DIM
        if MASKED:
            ok = ok & (t < k1)[:, None]
        x = tl.load(base + rr[:, None] * stride_r + c, mask=ok, other=0.0)
    else:
        x = _load_keys(base + rr[:, None] * stride_r + tl.arange(0, HEAD_DIM)[None, :], (t < k1)[:, None], MASKED)
    scales = _load_keys(scale_base + rr * stride_sr, t < k1, MASKED) if QUANT else tl.full([BLOCK_N], 1.0, tl.float32)
    return x, scales


@triton.jit
def _qk(q_tile, k, QUANT: tl.constexpr, QK_E4M3: tl.constexpr, DOT_PREC: tl.constexpr):
    """Raw scores q k^T [M, N] in fp32, before any scale: an e4m3 dot of codes (QK_E4M3), else in q's dtype."""
    if QK_E4M3:
        return tl.dot(q_tile, tl.trans(k), out_dtype=tl.float32)
    elif QUANT:
        return tl.dot(q_tile, tl.trans(k.to(q_tile.dtype)), input_precision=DOT_PREC)
    else:
        return tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC)


@triton.jit
def _update(q_tile, raw, k_s, v, v_s, start, row_lo, row_hi, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr, QK_E4M3: tl.constexpr, cap2,
            SOFTCAP: tl.constexpr):  # fmt: skip
    """One key block's online-softmax step from its raw scores and V tile (with their scales); q_tile
    gives the dots' dtype. MASKED: the block is masked to each row's [row_lo, row_hi).

    QUANT: e4m3 codes convert to q's dtype; the K scales scale the score columns and the V scales
    p before the PV dot (see `kernels`). QK_E4M3: raw holds e4m3 products and qk_scale is
    [BLOCK_M] (each row's q scale times the softmax scale); V converts to fp16 for the PV dot.
    SOFTCAP: each score is capped (its tanh, `tanh_capped`) before the mask; never with QK_E4M3 (the
    launcher's rule)."""
    tl.static_assert(not (SOFTCAP and QK_E4M3))
    if SOFTCAP:  # s = tanh(score / cap): 1/cap2 rides in the scores' scale, cap2 in exp2's FFMA below
        if QUANT:
            s = tanh_capped(raw * (k_s * (qk_scale / cap2))[None, :], SOFTCAP)
        else:
            s = tanh_capped(raw * (qk_scale / cap2), SOFTCAP)
    elif QK_E4M3:
        s = raw * k_s[None, :]  # log2 units / qk_scale rows
    elif QUANT:
        s = raw * (k_s * qk_scale)[None, :]  # [M, N], log2 units
    else:
        s = raw * qk_scale  # [M, N], log2 units
    if MASKED:
        t = start + tl.arange(0, BLOCK_N)
        s = tl.where((t[None, :] >= row_lo[:, None]) & (t[None, :] < row_hi[:, None]), s, NEG_INF)
    # SOFTCAP: m in log2 units, cap2 * the largest tanh (cap2 > 0)
    m_new = tl.maximum(m_i, tl.max(s, 1) * cap2) if SOFTCAP else tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays at exp2(-inf) = 0
    if QK_E4M3:  # s and m are scores / qk_scale (> 0): the row scale rides in exp2's argument, one FFMA
        alpha = tl.exp2((m_i - m_safe) * qk_scale)
        p = tl.exp2(s * qk_scale[:, None] - (m_safe * qk_scale - P_SHIFT)[:, None])
    else:
        alpha = tl.exp2(m_i - m_safe)
        if QUANT:  # p times 2^P_SHIFT, l_i with it (acc / l_i is unchanged): p * v_scale stays normal in fp16
            m_safe -= P_SHIFT
        p = tl.exp2(s * cap2 - m_safe[:, None] if SOFTCAP else s - m_safe[:, None])  # SOFTCAP: one FFMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    if QK_E4M3:
        p = p * v_s[None, :]
        v = v.to(tl.float16)
    elif QUANT:
        p = p * v_s[None, :]
        v = v.to(q_tile.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k_ring, start0, stop, k1,
                  row_lo, row_hi, m_i, l_i, acc, qk_scale, k_desc, v_desc, row0, col0, MASKED: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
                  QK_E4M3: tl.constexpr, TMA: tl.constexpr, cap2, SOFTCAP: tl.constexpr, stride_vr,
                  K_DIM: tl.constexpr, V_TILE: tl.constexpr, V_DIM: tl.constexpr):  # fmt: skip
    """Online softmax over key blocks [start0, stop) (keys < k1), continuing (m_i, l_i, acc); tiles
    as `_tile` loads them (TMA: unmasked blocks of one lap only): K [BLOCK_N, HEAD_DIM] of K_DIM
    columns, V [BLOCK_N, V_TILE] of V_DIM (V rows stride_vr apart)."""
    for start in range(start0, stop, BLOCK_N):
        k, k_s = _tile(k_base, k_desc, ks_base, stride_r, stride_sr, rows, k_ring, start, k1, row0, col0, MASKED,
                       BLOCK_N, HEAD_DIM, QUANT, TMA, K_DIM)  # fmt: skip
        raw = _qk(q_tile, k, QUANT, QK_E4M3, DOT_PREC)
        v, v_s = _tile(v_base, v_desc, vs_base, stride_vr, stride_sr, rows, k_ring, start, k1, row0, col0, MASKED,
                       BLOCK_N, V_TILE, QUANT, TMA, V_DIM)  # fmt: skip
        m_i, l_i, acc = _update(q_tile, raw, k_s, v, v_s, start, row_lo, row_hi, m_i, l_i, acc, qk_scale, MASKED,
                                BLOCK_N, DOT_PREC, QUANT, QK_E4M3, cap2, SOFTCAP)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _locate_block(info, n, pid, BLOCK_Q: tl.constexpr, Q_SHORT: tl.constexpr, ROWS: tl.constexpr):
    """(segment, its first long query block) of long query block `pid`, over the table's rows [0, n) read as
    one [ROWS] vector (n <= ROWS); a segment index >= n when pid is past the last one."""
    idx = tl.arange(0, ROWS)
    q_len_v = tl.load(info + idx * 4 + 1, mask=idx < n, other=0)
    nlb = tl.where(q_len_v > Q_SHORT, (q_len_v + BLOCK_Q - 1) // BLOCK_Q, 0)  # query blocks of long segments
    ends = tl.cumsum(nlb, 0)
    before = ends <= pid
    return tl.reduce((before.to(tl.int32), tl.where(before, ends, 0)), 0, _locate_combine)


@triton.jit
def long_kernel(q, k_store, v_store, k_scale, v_scale, info, live, out, k_desc, v_desc, S, T, rows, window, qk_scale,
                num_kv_heads,
                stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh, stride_ot,
                stride_oh, QUANT: tl.constexpr, QK_E4M3: tl.constexpr, HW_CAST: tl.constexpr, CAUSAL: tl.constexpr,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr, S_POW2: tl.constexpr,
                DOT_PREC: tl.constexpr, TMA: tl.constexpr, cap2, sinks, SOFTCAP: tl.constexpr,
                SINKS: tl.constexpr, stride_vr, stride_vc, stride_vh, K_DIM: tl.constexpr, V_TILE: tl.constexpr,
                V_DIM: tl.constexpr, SAME_STRIDES: tl.constexpr, GDC: tl.constexpr,
                TABLE_CHUNK: tl.constexpr):  # fmt: skip
    if SAME_STRIDES:  # V laid out as K: K's offsets serve V (one set of 64-bit row offsets, as one width had)
        stride_vr = stride_r
        stride_vc = stride_c
        stride_vh = stride_h
    pid = tl.program_id(0) // num_kv_heads
    h = tl.program_id(0) % num_kv_heads
    n = S  # rows read: the table's, or its live ones (as a TABLE_CHUNK-row table when they fit)
    if TABLE_CHUNK == S_POW2:
        s, first = _locate_block(info, S, pid, BLOCK_Q, Q_SHORT, S_POW2)
    else:
        n = tl.minimum(tl.load(live), S)
        if n <= TABLE_CHUNK:
            s, first = _locate_block(info, n, pid, BLOCK_Q, Q_SHORT, TABLE_CHUNK)
        else:
            s, first = _locate_block(info, n, pid, BLOCK_Q, Q_SHORT, S_POW2)
    if s >= n:
        return  # past the last long query block
    q_start = tl.load(info + s * 4)
    q_len = tl.load(info + s * 4 + 1)
    col = tl.load(info + s * 4 + 2).to(tl.int64)
    kv_end = tl.load(info + s * 4 + 3)
    pdl_enter(GDC)  # launched early: only the table (no grid of the step writes it) is read before the wait
    qb = (q_len + BLOCK_Q - 1) // BLOCK_Q - 1 - (pid - first)  # last query block first
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    i = qb * BLOCK_Q + r // GROUP
    token = q_start + i
    row_ok = (r < BLOCK_Q * GROUP) & (i < q_len) & (token >= 0) & (token < T)
    head = h * GROUP + r % GROUP
    q_ptrs = q + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    if K_DIM < HEAD_DIM:  # a padded key width: q's columns past it are 0
        q_tile = tl.load(q_ptrs, mask=row_ok[:, None] & (d[None, :] < K_DIM), other=0.0)
    else:
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
    k_base, v_base = k_store + base, v_store + (col * stride_vc + h * stride_vh)
    sc = col * stride_sc + h.to(tl.int64) * stride_sh  # this (column, KV head)'s scales
    ks_base, vs_base = k_scale + sc, v_scale + sc
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_TILE], tl.float32)
    m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, k0, a, k1,
                                  row_lo, row_hi, m_i, l_i, acc, qk_scale, k_desc, v_desc, 0, 0, True, BLOCK_N,
                                  HEAD_DIM, DOT_PREC, QUANT, QK_E4M3, False, cap2, SOFTCAP,
                                  stride_vr, K_DIM, V_TILE, V_DIM)  # fmt: skip
    one_lap = TMA and b - 1 - (k0 // rows) * rows < rows  # an interior within one lap: whole rows of one view
    if one_lap:
        flat = base // stride_r  # this (column, head)'s first row and column in [R, C * Hkv * D]
        m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, a, b,
                                      k1, row_lo, row_hi, m_i, l_i, acc, qk_scale, k_desc, v_desc,
                                      flat.to(tl.int32), (base - flat * stride_r).to(tl.int32), False, BLOCK_N,
                                      HEAD_DIM, DOT_PREC, QUANT, QK_E4M3, TMA, cap2, SOFTCAP,
                                      stride_vr, K_DIM, V_TILE, V_DIM)  # fmt: skip
    else:
        m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, a, b,
                                      k1, row_lo, row_hi, m_i, l_i, acc, qk_scale, k_desc, v_desc, 0, 0, False,
                                      BLOCK_N, HEAD_DIM, DOT_PREC, QUANT, QK_E4M3, False, cap2, SOFTCAP,
                                      stride_vr, K_DIM, V_TILE, V_DIM)  # fmt: skip
    m_i, l_i, acc = _attend_range(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, b, k1, k1,
                                  row_lo, row_hi, m_i, l_i, acc, qk_scale, k_desc, v_desc, 0, 0, True, BLOCK_N,
                                  HEAD_DIM, DOT_PREC, QUANT, QK_E4M3, False, cap2, SOFTCAP,
                                  stride_vr, K_DIM, V_TILE, V_DIM)  # fmt: skip
    o = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    if SINKS:  # the row's log2-sum-exp over all its keys (P_SHIFT and the e4m3 row scales taken out)
        l_ok = tl.where(l_i > 0, l_i, 1.0)
        m_log2 = m_i * qk_scale if QK_E4M3 else m_i  # (QK_E4M3: maxima of scores / the row's qk_scale)
        lse = m_log2 + tl.log2(l_ok) - (P_SHIFT if QUANT else 0.0)
        o = o * sink_weight(tl.where(l_i > 0, lse, NEG_INF)[:, None], sinks, head[:, None], row_ok[:, None])
    dv = tl.arange(0, V_TILE)
    ptrs = out + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
    if V_DIM < V_TILE:
        tl.store(ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM))
    else:
        tl.store(ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])
