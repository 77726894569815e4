"""Device code of the split path's warp-split tiles (`SdpaConfig.warp_split`): keys cut across warps.

With one KV head per program, a [BLOCK_M, D] x [D, BLOCK_N] score tile on 4 warps gives each warp
BLOCK_N / 4 of the keys, so every key block pays cross-warp max and sum reductions and a shared
memory round trip of p before the PV dot, whose output is cut across warps by D (9 CTA barriers per
block on sm_90 with Triton 3.6, `bench/kernel_bench.py --compile-sm90`). For one or a few query rows that chain of
barriers, not the bytes, sets the time of a block. Here warp w owns keys [w * SUB, (w + 1) * SUB)
of every tile (SUB = BLOCK_N / SPLIT) with its own (m_i, l_i, acc): 3-D tiles [SPLIT, BLOCK_M, ...]
whose batch axis Triton puts on the warps, so scores, p and the PV dot stay in the warp's
registers, and the SPLIT states merge once per piece by their log-sum-exp. The cost: q and acc per
warp (acc is BLOCK_M * D / 32 fp32 registers per thread).
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.sdpa.common import NEG_INF, P_SHIFT, prefetch_keys, ring_rows, soft_cap, unpack_pairs


@triton.jit
def attend_warp_split(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_sr, rows, k0, k1, row_lo, row_hi,
                      full_lo, full_hi, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, SKIP_MASKS: tl.constexpr, DOT_PREC: tl.constexpr,
                      QUANT: tl.constexpr, CVT_ASM: tl.constexpr, PREFETCH: tl.constexpr, SECTOR: tl.constexpr,
                      CHECK: tl.constexpr, cap2=0.0, SOFTCAP: tl.constexpr = False):  # fmt: skip
    """`attend.attend` for one KV head, keys cut across SPLIT warps.

    q_tile: [1, BLOCK_M, D]; k_base, v_base: the (column, KV head) at key row 0; row_lo, row_hi:
    [BLOCK_M]. Returns the normalised output [1, BLOCK_M, D] and its lse [1, BLOCK_M] (log2 units).
    QUANT: e4m3 codes read as int16 pairs, dots split by column parity, as in `attend.py`.
    PREFETCH: the loop asks the L2 for the block PREFETCH blocks ahead (`prefetch_keys`). SOFTCAP: as in `attend`."""
    SUB: tl.constexpr = BLOCK_N // SPLIT
    DIM: tl.constexpr = HEAD_DIM // 2 if QUANT else HEAD_DIM  # elements a load reads per key
    q3 = tl.broadcast_to(tl.reshape(q_tile, [1, BLOCK_M, HEAD_DIM]), [SPLIT, BLOCK_M, HEAD_DIM])
    key = tl.arange(0, SPLIT)[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [SPLIT, SUB]: a tile's keys by warp
    d = tl.arange(0, DIM)[None, None, :]
    lo3 = row_lo[None, :, None]
    hi3 = row_hi[None, :, None]
    m_i = tl.full([SPLIT, BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([SPLIT, BLOCK_M], tl.float32)
    acc = tl.zeros([SPLIT, BLOCK_M, DIM], tl.float32)  # e4m3: the even output columns (acc_odd: the odd)
    if QUANT:  # codes as int16 pairs; q's columns 0, 2, .. and 1, 3, ..
        k_ptr = k_base.to(tl.pointer_type(tl.int16))
        v_ptr = v_base.to(tl.pointer_type(tl.int16))
        stride_rl = stride_r // 2
        q_even, q_odd = tl.split(tl.reshape(q3, [SPLIT, BLOCK_M, DIM, 2]))
        acc_odd = tl.zeros([SPLIT, BLOCK_M, DIM], tl.float32)
    else:
        k_ptr, v_ptr, stride_rl = k_base, v_base, stride_r
    for start in range(k0, k1, BLOCK_N):
        t = start + key  # key positions
        rr = ring_rows(t, k0, rows).to(tl.int64)
        r = (rr * stride_rl)[:, :, None]
        in_range = (t < k1)[:, :, None]
        k = tl.load(k_ptr + r + d, mask=in_range, other=0.0)  # [SPLIT, SUB, D] (e4m3: [SPLIT, SUB, D / 2] pairs)
        v = tl.load(v_ptr + r + d, mask=in_range, other=0.0)
        t_s = t[:, None, :]  # [SPLIT, 1, SUB]: one key per score column
        if QUANT:
            sr = (rr * stride_sr)[:, None, :]
            k_s = tl.load(ks_base + sr, mask=t_s < k1, other=0.0) * qk_scale
            v_s = tl.load(vs_base + sr, mask=t_s < k1, other=0.0)
            k_even, k_odd = unpack_pairs(k, q3.dtype, CVT_ASM)
            if DIM >= 16:
                s = tl.dot(q_even, tl.trans(k_even, (0, 2, 1)), input_precision=DOT_PREC)
                s = tl.dot(q_odd, tl.trans(k_odd, (0, 2, 1)), s, input_precision=DOT_PREC) * k_s  # [SPLIT, M, SUB]
            else:  # D = 16: a GPU dot contracts >= 16 columns, so K goes back to [SPLIT, SUB, D] for one dot
                k = tl.reshape(tl.join(k_even, k_odd), [SPLIT, SUB, HEAD_DIM])
                s = tl.dot(q3, tl.trans(k, (0, 2, 1)), input_precision=DOT_PREC) * k_s
        else:
            s = tl.dot(q3, tl.trans(k, (0, 2, 1)), input_precision=DOT_PREC) * qk_scale  # [SPLIT, M, SUB]
        if SOFTCAP:
            s = soft_cap(s, cap2, SOFTCAP)
        if PREFETCH > 0:
            trip = prefetch_keys(k_base, v_base, stride_r, 0, rows, k0, start + PREFETCH * BLOCK_N, k1, BLOCK_N, 1,
                                 HEAD_DIM, SECTOR, CHECK)  # fmt: skip
            if CHECK:
                s += trip
        if SKIP_MASKS:
            if (start < full_lo) | (start + BLOCK_N > full_hi):  # an edge block: some row misses some key
                s = tl.where((t_s >= lo3) & (t_s < hi3), s, NEG_INF)
        else:
            s = tl.where((t_s >= lo3) & (t_s < hi3), s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays at exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_safe)
        if QUANT:  # p times 2^P_SHIFT, l_i with it: p * v_s stays in fp16's normal range
            m_safe -= P_SHIFT
        p = tl.exp2(s - m_safe[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        if QUANT:
            v_even, v_odd = unpack_pairs(v, q3.dtype, CVT_ASM)
            p = (p * v_s).to(q3.dtype)
            acc = acc * alpha[:, :, None] + tl.dot(p, v_even, input_precision=DOT_PREC)
            acc_odd = acc_odd * alpha[:, :, None] + tl.dot(p, v_odd, input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    if QUANT:  # interleave the even and odd output columns
        acc = tl.reshape(tl.join(acc, acc_odd), [SPLIT, BLOCK_M, HEAD_DIM])
    # the SPLIT states of each row by their maxima: a warp that saw none of a row's keys weighs 0
    m = tl.max(m_i, 0)
    w = tl.exp2(m_i - tl.where(m == NEG_INF, 0.0, m)[None, :])  # [SPLIT, M]
    l_all = tl.sum(l_i * w, 0)
    o = tl.sum(acc * w[:, :, None], 0)  # [M, D]
    has = l_all > 0
    l_safe = tl.where(has, l_all, 1.0)
    o = tl.where(has[:, None], o / l_safe[:, None], 0.0)
    lse = tl.where(has, m + tl.log2(l_safe) - (P_SHIFT if QUANT else 0.0), NEG_INF)
    return tl.reshape(o, [1, BLOCK_M, HEAD_DIM]), tl.reshape(lse, [1, BLOCK_M])
