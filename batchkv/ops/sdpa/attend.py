"""Device code of the split path's tile loop: online softmax of a query tile over a key range.

`attend` walks keys [k0, k1) of one (column, KV head group) in BLOCK_N-key tiles for
`kernels.split_kernel`. One head runs as plain 2-D tiles (q [M, D], keys [N, D],
scores [M, N]); several heads as 3-D tiles with the head axis first.

e4m3 stores (QUANT): the codes are read as int16 pairs, [N, D / 2] tiles whose elements are two
adjacent codes (`unpack_pairs`), so both dots take 16-bit operands in their native layouts: the
scores are q_even @ K_even^T + q_odd @ K_odd^T (q split by column parity once per piece), and
p @ V is two dots giving the even and odd output columns, interleaved once after the loop (at
D = 16 the halves have 8 columns, fewer than a GPU dot contracts, so K's are joined back into one
[N, 16] tile for a single QK dot; the PV dots contract over keys and stay split). Each
tile loads one [BLOCK_N] K scale vector per head (times qk_scale), folded into the score columns,
and one V scale vector, folded into p before the PV dot (l_i sums p without it; p and l_i are
2^P_SHIFT times larger, `common.P_SHIFT`). With the
store's scale layout (rows contiguous per column and head) a vector is BLOCK_N * 4 contiguous bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.sdpa.common import NEG_INF, P_SHIFT, prefetch_keys, ring_rows, soft_cap, unpack_pairs


@triton.jit
def _qk(q, k, acc, HEADS: tl.constexpr, DOT_PREC: tl.constexpr):
    """q @ k^T (+ acc): [M, D] x [N, D] -> [M, N], or per head [H, M, D] x [H, N, D] -> [H, M, N]."""
    if HEADS == 1:
        s = tl.dot(q, tl.trans(k), acc, input_precision=DOT_PREC)
    else:
        s = tl.dot(q, tl.trans(k, (0, 2, 1)), acc, input_precision=DOT_PREC)
    return s


@triton.jit
def attend(q_tile, k_base, v_base, ks_base, vs_base, stride_r, stride_h, stride_sr, stride_sh, rows, k0, k1, row_lo,
           row_hi, full_lo, full_hi, qk_scale, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           HEAD_DIM: tl.constexpr, SKIP_MASKS: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
           CVT_ASM: tl.constexpr, PREFETCH: tl.constexpr, SECTOR: tl.constexpr, CHECK: tl.constexpr, cap2=0.0,
           SOFTCAP: tl.constexpr = False):  # fmt: skip
    """Online softmax of [HEADS, BLOCK_M, D] queries over keys [k0, k1) (block-aligned pieces).

    k_base, v_base: the first head's (column, KV head) at key row 0; row_lo, row_hi: [BLOCK_M]. Returns the
    normalised output [HEADS, BLOCK_M, D] and its lse [HEADS, BLOCK_M] (log2 units). One head
    runs as plain 2-D tiles: a batched dot whose batch is smaller than the warp count replicates
    work in some Triton versions (3.6 puts every warp on the batch axis).
    QUANT (e4m3 stores): q_tile is fp16 or fp32 (the dots' dtype); ks_base, vs_base point at the
    first head's scales at key row 0 (row stride stride_sr, head stride stride_sh); CVT_ASM as in
    `unpack_pairs`. PREFETCH: each block asks the L2 for the block PREFETCH blocks ahead (`prefetch_keys`).
    SOFTCAP: each score (log2 units) is capped, `soft_cap(s, cap2)`, before the mask."""
    DIM: tl.constexpr = HEAD_DIM // 2 if QUANT else HEAD_DIM  # elements a load reads per key and head
    AXIS: tl.constexpr = 1 if HEADS == 1 else 2  # the key axis of the scores
    if QUANT:  # codes as int16 pairs
        k_ptr = k_base.to(tl.pointer_type(tl.int16))
        v_ptr = v_base.to(tl.pointer_type(tl.int16))
        stride_rl = stride_r // 2
        stride_hl = stride_h // 2
    else:
        k_ptr, v_ptr, stride_rl, stride_hl = k_base, v_base, stride_r, stride_h
    if HEADS == 1:  # 2-D: q [M, D], keys [N, D], scores [M, N]
        q_tile = tl.reshape(q_tile, [BLOCK_M, HEAD_DIM])
        d = tl.arange(0, DIM)[None, :]
        row_lo = row_lo[:, None]
        row_hi = row_hi[:, None]
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], tl.float32)  # e4m3: the even output columns (acc_odd: the odd)
    else:  # 3-D: q [H, M, D], keys [H, N, D], scores [H, M, N]
        d = tl.arange(0, HEADS)[:, None, None] * stride_hl + tl.arange(0, DIM)[None, None, :]  # < Hkv * D
        row_lo = row_lo[None, :, None]
        row_hi = row_hi[None, :, None]
        m_i = tl.full([HEADS, BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([HEADS, BLOCK_M], tl.float32)
        acc = tl.zeros([HEADS, BLOCK_M, DIM], tl.float32)
    if QUANT:  # q's columns 0, 2, .. and 1, 3, ..
        q_even, q_odd = tl.split(tl.reshape(q_tile, [HEADS, BLOCK_M, DIM, 2]))
        if HEADS == 1:
            q_even = tl.reshape(q_even, [BLOCK_M, DIM])
            q_odd = tl.reshape(q_odd, [BLOCK_M, DIM])
        acc_odd = tl.zeros(acc.shape, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(k0, k1, BLOCK_N):
        t = start + offs_n  # key positions
        rr = ring_rows(t, k0, rows).to(tl.int64)
        r = rr * stride_rl
        sr = rr * stride_sr
        if HEADS == 1:
            r = r[:, None]
            in_range = (t < k1)[:, None]
            t_s = t[None, :]
            sr = sr[None, :]  # [1, N]: one scale per score column
            s_range = (t < k1)[None, :]
        else:
            r = r[None, :, None]
            in_range = (t < k1)[None, :, None]
            t_s = t[None, None, :]
            sr = tl.arange(0, HEADS)[:, None, None] * stride_sh + sr[None, None, :]  # [H, 1, N]
            s_range = (t < k1)[None, None, :]
        k = tl.load(k_ptr + r + d, mask=in_range, other=0.0)
        v = tl.load(v_ptr + r + d, mask=in_range, other=0.0)
        if QUANT:
            k_s = tl.load(ks_base + sr, mask=s_range, other=0.0) * qk_scale
            v_s = tl.load(vs_base + sr, mask=s_range, other=0.0)
            k_even, k_odd = unpack_pairs(k, q_tile.dtype, CVT_ASM)
            if DIM >= 16:
                s = _qk(q_odd, k_odd, _qk(q_even, k_even, None, HEADS, DOT_PREC), HEADS, DOT_PREC) * k_s
            else:  # D = 16: a GPU dot contracts >= 16 columns, so K goes back to [.., N, D] for one dot
                if HEADS == 1:
                    k = tl.reshape(tl.join(k_even, k_odd), [BLOCK_N, HEAD_DIM])
                else:
                    k = tl.reshape(tl.join(k_even, k_odd), [HEADS, BLOCK_N, HEAD_DIM])
                s = _qk(q_tile, k, None, HEADS, DOT_PREC) * k_s
        elif HEADS == 1:
            s = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        else:
            s = tl.dot(q_tile, tl.trans(k, (0, 2, 1)), input_precision=DOT_PREC) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, cap2)
        if PREFETCH > 0:
            trip = prefetch_keys(k_base, v_base, stride_r, stride_h, rows, k0, start + PREFETCH * BLOCK_N, k1, BLOCK_N,
                                 HEADS, HEAD_DIM, SECTOR, CHECK)  # fmt: skip
            if CHECK:
                s += trip
        if SKIP_MASKS:
            if (start < full_lo) | (start + BLOCK_N > full_hi):  # an edge block: some row misses some key
                s = tl.where((t_s >= row_lo) & (t_s < row_hi), s, NEG_INF)
        else:
            s = tl.where((t_s >= row_lo) & (t_s < row_hi), s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, AXIS))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays at exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_safe)
        if QUANT:  # p times 2^P_SHIFT, l_i with it: p * v_s stays in fp16's normal range
            m_safe -= P_SHIFT
        p = tl.exp2(s - tl.expand_dims(m_safe, AXIS))
        l_i = l_i * alpha + tl.sum(p, AXIS)
        if QUANT:
            v_even, v_odd = unpack_pairs(v, q_tile.dtype, CVT_ASM)
            p = (p * v_s).to(q_tile.dtype)
            acc = acc * tl.expand_dims(alpha, AXIS) + tl.dot(p, v_even, input_precision=DOT_PREC)
            acc_odd = acc_odd * tl.expand_dims(alpha, AXIS) + tl.dot(p, v_odd, input_precision=DOT_PREC)
        else:
            acc = acc * tl.expand_dims(alpha, AXIS) + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    if QUANT:  # interleave the even and odd output columns: [..., D / 2, 2] -> [..., D]
        if HEADS == 1:
            acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, HEAD_DIM])
        else:
            acc = tl.reshape(tl.join(acc, acc_odd), [HEADS, BLOCK_M, HEAD_DIM])
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o = tl.where(tl.expand_dims(has, AXIS), acc / tl.expand_dims(l_safe, AXIS), 0.0)
    lse = tl.where(has, m_i + tl.log2(l_safe) - (P_SHIFT if QUANT else 0.0), NEG_INF)
    return tl.reshape(o, [HEADS, BLOCK_M, HEAD_DIM]), tl.reshape(lse, [HEADS, BLOCK_M])
