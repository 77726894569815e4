"""Device code of the split path's merge: the last program to finish an item combines its partials.

Programs p_first..p_last of an item each left a normalised fp32 output and its log2-sum-exp in
partial slot p + item (`kernels.split_kernel`); the last of them to arrive reads them
all back from the L2 (.cg: the acq_rel counter made the others' stores visible) and writes `out`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.sdpa.common import NEG_INF, sink_weight


@triton.jit
def merge_partials(out, o_part, lse_part, it, p_first, p_last, h0, num_kv_heads, q_start, q_len, qb, T, stride_ot,
                   stride_oh, GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_Q: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SLOTS: tl.constexpr,
                   MERGE_STAGES: tl.constexpr, sinks, SINKS: tl.constexpr):  # fmt: skip
    """Combine the partials of programs p_first..p_last (slots p + it) by their lse into `out`,
    MERGE_ROWS tile rows of every head and MERGE_SLOTS programs per round trip. Everything stays
    [slots, rows, D]-shaped (keep_dims), so no layout changes inside the loop. MERGE_STAGES > 1
    software-pipelines the rounds (the next round's partials load while this one combines).
    SINKS: each row's merged output is scaled by its head's `sink_weight` (once per row: the
    partials are normalised over their own keys only)."""
    u = tl.arange(0, HEADS * MERGE_ROWS)[None, :, None]  # (head, row) pairs of a round
    hh = u // MERGE_ROWS
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    j = tl.arange(0, MERGE_SLOTS)[:, None, None]
    valid = tl.minimum(q_len - qb * BLOCK_Q, BLOCK_Q) * GROUP  # tile rows with a query
    for r0 in range(0, valid, MERGE_ROWS):
        r = r0 + u % MERGE_ROWS
        token = q_start + qb * BLOCK_Q + r // GROUP
        ok = (r < valid) & (token >= 0) & (token < T)  # [1, R, 1]
        m_i = tl.full([1, HEADS * MERGE_ROWS, 1], NEG_INF, tl.float32)
        l_i = tl.zeros([1, HEADS * MERGE_ROWS, 1], tl.float32)
        acc = tl.zeros([1, HEADS * MERGE_ROWS, HEAD_DIM], tl.float32)
        for c0 in tl.range(p_first, p_last + 1, MERGE_SLOTS, num_stages=MERGE_STAGES):
            row = ((c0 + j + it).to(tl.int64) * num_kv_heads + h0 + hh) * BLOCK_M + r  # [SLOTS, R, 1], slot p + it
            live = (c0 + j <= p_last) & ok
            lse = tl.load(lse_part + row, mask=live, other=NEG_INF, cache_modifier=".cg")
            o = tl.load(o_part + row * HEAD_DIM + d, mask=live, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_i, tl.max(lse, 0, keep_dims=True))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            w = tl.exp2(lse - m_safe)
            l_i = l_i * alpha + tl.sum(w, 0, keep_dims=True)
            acc = acc * alpha + tl.sum(w * o, 0, keep_dims=True)
            m_i = m_new
        res = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
        head = (h0 + hh) * GROUP + r % GROUP
        if SINKS:
            lse_all = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), NEG_INF)
            res = res * sink_weight(lse_all, sinks, head, ok)
        ptrs = out + token.to(tl.int64) * stride_ot + head * stride_oh + d
        tl.store(ptrs, res.to(out.dtype.element_ty), mask=ok)
