"""Device code of `sdpa_varlen` (the launcher and the contract are in `sdpa_varlen.py`).

Three kernels, every grid sized from static extents only:

1. `split_kernel`, grid (Hkv, P): split-K (flash-decoding) for *short* segments, 0 < q_len <=
   Q_SHORT. A short segment is cut into query blocks of BLOCK_Q queries (a tile holds BLOCK_Q * G
   (query, group head) rows, padded to BLOCK_M >= 16 for tl.dot); each query block is an *item*
   whose work is the segment's key range [first key, kv_end) in BLOCK_N-key blocks. All items end
   to end form one axis of W key blocks, and program p < P_eff = clamp(W // MIN_BLOCKS, 1, P) takes
   blocks [p*W//P_eff, (p+1)*W//P_eff) (stream-K): every program gets the same work, within one
   block, whatever the mix of lengths, and the persistent grid fills the GPU in one wave. A
   program's range may cross item boundaries; each (program, item) piece writes its normalised
   output and log2-sum-exp in fp32 to partial slot `p + item` (unique: both grow along the axis).
   Programs without blocks exit after reading the table.
2. `long_kernel`, grid (query blocks bound, Hkv): one program per BLOCK_Q queries of a *long*
   segment (q_len > Q_SHORT), over its whole key range, written straight to `out`.
3. `merge_kernel`, grid (T, Hq): finds a row's segment by scanning the table, writes zeros for
   uncovered rows, leaves long rows alone, and for short rows merges the partials of the programs
   that touched the row's item, CHUNK at a time in one vector load (usually a single round trip).

Every program derives the plan from `seq_info` on the device (cumsums over S entries), so no
length ever reaches the host. Names follow FlashAttention: m_i running max, l_i running sum, acc,
alpha rescale, lse; scores are in log2 units (1/ln2 folded into qk_scale, exp2). Store offsets are
int64. The kernels trust the table (the launcher checks shapes; contents are the cache's job), but
never write outside `out` or the workspace even if segments overlap.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _pick(vec, idx, s):
    """vec[s] of a [S_POW2] vector, as a scalar."""
    return tl.sum(tl.where(idx == s, vec, 0), 0)


@triton.jit
def _find(ends, x):
    """Index of the first entry of the inclusive cumsum `ends` that is > x."""
    return tl.sum((ends <= x).to(tl.int32), 0)


@triton.jit
def _first_key(q_len, kv_end, rows, window, CAUSAL: tl.constexpr):
    """First key any query of a segment attends (vectors or scalars alike)."""
    lo = tl.maximum(kv_end - rows, 0)  # oldest resident key
    if CAUSAL:
        return tl.where(window > 0, tl.maximum(lo, kv_end - q_len - window + 1), lo)  # first query's window
    return tl.where(window > 0, tl.maximum(lo, kv_end - window), lo)


@triton.jit
def _segments(info, S, S_POW2: tl.constexpr):
    """Table columns as [S_POW2] vectors: q_start, q_len, kv_end (zeros past S)."""
    idx = tl.arange(0, S_POW2)
    ok = idx < S
    q_start = tl.load(info + idx * 4, mask=ok, other=0)
    q_len = tl.load(info + idx * 4 + 1, mask=ok, other=0)
    kv_end = tl.load(info + idx * 4 + 3, mask=ok, other=0)
    return idx, q_start, q_len, kv_end


@triton.jit
def _num_blocks(q_len, kv_end, rows, window, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of a segment's range [first key, kv_end)."""
    lo = _first_key(q_len, kv_end, rows, window, CAUSAL)
    return (tl.maximum(kv_end - lo, 0) + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _short_plan(q_len, kv_end, rows, window, P, CAUSAL: tl.constexpr, Q_SHORT: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BLOCKS: tl.constexpr):  # fmt: skip
    """Split-kernel items (nq query blocks per short segment, each nblk key blocks wide), their
    inclusive cumsums, the axis length W and the programs that share it, P_eff <= P."""
    nblk = _num_blocks(q_len, kv_end, rows, window, CAUSAL, BLOCK_N)
    nq = tl.where((q_len > 0) & (q_len <= Q_SHORT) & (nblk > 0), (q_len + BLOCK_Q - 1) // BLOCK_Q, 0)
    W = tl.sum(nq * nblk, 0).to(tl.int64)
    P_eff = tl.maximum(tl.minimum(W // MIN_BLOCKS, P), 1)  # each program gets >= MIN_BLOCKS blocks
    return nblk, nq, tl.cumsum(nq, 0), tl.cumsum(nq * nblk, 0), W, P_eff


@triton.jit
def _item_at(x, idx, nblk, nq, item_end, w_end):
    """Index of the item holding key block x of the work axis."""
    s = _find(w_end, x)
    first_block = _pick(w_end - nq * nblk, idx, s)
    return _pick(item_end - nq, idx, s) + (x - first_block) // _pick(nblk, idx, s)


@triton.jit
def _query_tile(q, q_start, q_len, kv_end, qb, h, T, stride_qt, stride_qh, GROUP: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """[BLOCK_M, D] tile: row r is query qb*BLOCK_Q + r // G of the segment, head h*G + r % G."""
    r = tl.arange(0, BLOCK_M)
    i = qb * BLOCK_Q + r // GROUP
    token = q_start + i  # packed row
    row_ok = (r < BLOCK_Q * GROUP) & (i < q_len) & (token < T)
    head = h * GROUP + r % GROUP
    ptrs = q + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + tl.arange(0, HEAD_DIM)[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0), row_ok, token, kv_end - q_len + i


@triton.jit
def _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL: tl.constexpr):
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
def _attend(q_tile, k_base, v_base, stride_r, rows, k0, k1, row_lo, row_hi, qk_scale, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """Online softmax of a query tile over keys [k0, k1) of one (column, KV head)."""
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    for start in range(k0, k1, BLOCK_N):
        t = start + offs_n  # key positions
        in_range = t < k1
        r = (t % rows).to(tl.int64)[:, None] * stride_r + d[None, :]  # ring row of each key
        k = tl.load(k_base + r, mask=in_range[:, None], other=0.0)
        s = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
        allowed = (t[None, :] >= row_lo[:, None]) & (t[None, :] < row_hi[:, None]) & in_range[None, :]
        s = tl.where(allowed, s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays at exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + r, mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _normalise(acc, m_i, l_i):
    """(acc / l_i, lse) with zeros and -inf for rows that saw no key."""
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    return tl.where(has[:, None], acc / l_safe[:, None], 0.0), tl.where(has, m_i + tl.log2(l_safe), NEG_INF)


@triton.jit
def split_kernel(q, k_store, v_store, info, o_part, lse_part, S, T, rows, window, qk_scale, P, SLOTS,
                 stride_qt, stride_qh, stride_r, stride_c, stride_h,
                 CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr, S_POW2: tl.constexpr,
                 MIN_BLOCKS: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    p = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    idx, _starts, q_len_v, kv_end_v = _segments(info, S, S_POW2)
    nblk, nq, item_end, w_end, W, P_eff = _short_plan(
        q_len_v, kv_end_v, rows, window, P, CAUSAL, Q_SHORT, BLOCK_Q, BLOCK_N, MIN_BLOCKS
    )
    b0 = (p * W) // P_eff  # this program's key blocks [b0, b1) of the work axis
    b1 = ((p + 1) * W) // P_eff
    if (p >= P_eff) | (b0 >= b1):
        return
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    first = _item_at(b0, idx, nblk, nq, item_end, w_end)
    last = _item_at(b1 - 1, idx, nblk, nq, item_end, w_end)
    for it in range(first, last + 1):
        s = _find(item_end, it)
        q_start = tl.load(info + s * 4)
        q_len = tl.load(info + s * 4 + 1)
        col = tl.load(info + s * 4 + 2).to(tl.int64)
        kv_end = tl.load(info + s * 4 + 3)
        qb = it - _pick(item_end - nq, idx, s)  # query block of the segment
        nb = _num_blocks(q_len, kv_end, rows, window, CAUSAL, BLOCK_N)
        off = _pick(w_end - nq * nblk, idx, s) + qb * nb  # the item's first block on the axis
        lo = _first_key(q_len, kv_end, rows, window, CAUSAL)
        k0 = lo + (tl.maximum(off, b0) - off).to(tl.int32) * BLOCK_N
        k1 = tl.minimum(kv_end, lo + (tl.minimum(off + nb, b1) - off).to(tl.int32) * BLOCK_N)
        q_tile, row_ok, _rows, pos = _query_tile(
            q, q_start, q_len, kv_end, qb, h, T, stride_qt, stride_qh, GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM
        )
        row_lo, row_hi = _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL)
        base = col * stride_c + h * stride_h  # (column, KV head)
        acc, m_i, l_i = _attend(
            q_tile.to(k_store.dtype.element_ty), k_store + base, v_store + base, stride_r, rows, k0, k1,
            row_lo, row_hi, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PREC,
        )  # fmt: skip
        o, lse = _normalise(acc, m_i, l_i)
        row = ((p + it).to(tl.int64) * num_kv_heads + h) * BLOCK_M + r  # partial slot p + item
        keep = row_ok & ((p + it + 0 * r) < SLOTS)  # slots always fit, unless the table overlaps itself
        tl.store(lse_part + row, lse, mask=keep)
        tl.store(o_part + row[:, None] * HEAD_DIM + d[None, :], o, mask=keep[:, None])


@triton.jit
def long_kernel(q, k_store, v_store, info, out, S, T, rows, window, qk_scale,
                stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_ot, stride_oh,
                CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr, S_POW2: tl.constexpr,
                DOT_PREC: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1)
    idx, _starts, q_len_v, _ends = _segments(info, S, S_POW2)
    nlb = tl.where(q_len_v > Q_SHORT, (q_len_v + BLOCK_Q - 1) // BLOCK_Q, 0)  # query blocks of long segments
    ends = tl.cumsum(nlb, 0)
    if pid >= tl.sum(nlb, 0):
        return
    s = _find(ends, pid)
    qb = pid - _pick(ends - nlb, idx, s)
    q_start = tl.load(info + s * 4)
    q_len = tl.load(info + s * 4 + 1)
    col = tl.load(info + s * 4 + 2).to(tl.int64)
    kv_end = tl.load(info + s * 4 + 3)
    q_tile, row_ok, token, pos = _query_tile(
        q, q_start, q_len, kv_end, qb, h, T, stride_qt, stride_qh, GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM
    )
    row_lo, row_hi = _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL)
    k0 = tl.min(tl.where(row_ok, row_lo, kv_end), 0).to(tl.int32)
    k1 = tl.max(tl.where(row_ok, row_hi, 0), 0).to(tl.int32)
    base = col * stride_c + h * stride_h
    acc, m_i, l_i = _attend(
        q_tile.to(k_store.dtype.element_ty), k_store + base, v_store + base, stride_r, rows, k0, k1, row_lo, row_hi,
        qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PREC,
    )  # fmt: skip
    o, _ = _normalise(acc, m_i, l_i)
    r = tl.arange(0, BLOCK_M)
    head = h * GROUP + r % GROUP
    ptrs = out + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def merge_kernel(out, o_part, lse_part, info, S, rows, window, P, SLOTS, stride_ot, stride_oh,
                 CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr, S_POW2: tl.constexpr,
                 MIN_BLOCKS: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    head = tl.program_id(1)  # query head
    h = head // GROUP
    num_kv_heads = tl.num_programs(1) // GROUP
    idx, q_start_v, q_len_v, kv_end_v = _segments(info, S, S_POW2)
    covered = (q_start_v <= t) & (t < q_start_v + q_len_v) & (idx < S)
    s = tl.sum(tl.where(covered, idx, 0), 0)
    is_covered = tl.sum(covered.to(tl.int32), 0) > 0
    if is_covered & (_pick(q_len_v, idx, s) > Q_SHORT):
        return  # a long segment's row: long_kernel wrote it
    nblk, nq, item_end, w_end, W, P_eff = _short_plan(
        q_len_v, kv_end_v, rows, window, P, CAUSAL, Q_SHORT, BLOCK_Q, BLOCK_N, MIN_BLOCKS
    )
    W = tl.maximum(W, 1)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, CHUNK)
    m_i = tl.max(tl.full([CHUNK], NEG_INF, tl.float32), 0)
    l_i = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    if is_covered & (_pick(nq, idx, s) > 0):
        i = t - _pick(q_start_v, idx, s)  # query index in the segment
        qb = i // BLOCK_Q
        it = _pick(item_end - nq, idx, s) + qb
        nb = _pick(nblk, idx, s)
        off = (_pick(w_end - nq * nblk, idx, s) + qb * nb).to(tl.int64)  # item's blocks: [off, off + nb)
        tile_row = (i - qb * BLOCK_Q) * GROUP + head % GROUP
        p_last = ((off + nb) * P_eff - 1) // W
        for p0 in range(((off + 1) * P_eff - 1) // W, p_last + 1, CHUNK):  # programs touching the item
            p = p0 + j
            blocks = ((p + 1) * W) // P_eff - (p * W) // P_eff  # 0: program p had no work, wrote nothing
            live = (p <= p_last) & (blocks > 0) & (p + it < SLOTS)
            row = ((p + it) * num_kv_heads + h) * BLOCK_M + tile_row
            lse = tl.load(lse_part + row, mask=live, other=NEG_INF)
            o = tl.load(o_part + row[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_i, tl.max(lse, 0))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            w = tl.exp2(lse - m_safe)
            l_i = l_i * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m_i = m_new
    o = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(out + t.to(tl.int64) * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty))
