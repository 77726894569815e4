"""`sdpa_varlen`'s split-KV variant for narrow steps (`SdpaConfig.split_merge`): two launches, no atomics.

For steps of at most Q_SHORT tokens (one or a few decoding or verifying sequences), where the
time is latency, not bandwidth: the stream-K kernel (`sdpa_varlen_kernels`) locates each program's
blocks with a scan over the table and merges in the last program to finish an item (a fence, an
atomic, and a merge that starts only after the slowest program). Here instead:

- `splitkv_partials`, grid (Hkv, P): every live segment's key range is cut into P equal runs of
  whole BLOCK_N-key blocks, one per program, so program p takes run p of every live segment (at
  most T of them) with no scan; each run's normalised fp32 output and log2-sum-exp go to partial
  slot (segment rank, head, p). An empty run writes lse = -inf. Like the main path, it trusts the
  table's contents but writes nothing outside `out` and its workspace, whatever they hold.
- `splitkv_merge`, grid (T, Hkv): one program per (token, KV head) combines the P partials of its
  group's query heads, or writes zeros for a token no segment covers.

One segment's rows (q_len * G <= BLOCK_M, BLOCK_M from T) form one tile, so K and V are read once
per group. Graph-safe like the main path: grids and workspace depend on T, S and P only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchkv.ops.sdpa_varlen_attend import attend
from batchkv.ops.sdpa_varlen_common import NEG_INF, first_key, full_bounds, load_table, row_bounds


@triton.jit
def _pick(vec, hit):
    """The element of `vec` where the one-hot `hit` is set (0 where none is)."""
    return tl.sum(tl.where(hit, vec, 0), 0)


@triton.jit
def splitkv_partials(q, k_store, v_store, k_scale, v_scale, info, o_part, lse_part, S, T, rows, window, qk_scale,
                     stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh,
                     QUANT: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S_POW2: tl.constexpr, SKIP_MASKS: tl.constexpr,
                     DOT_PREC: tl.constexpr, SECTOR: tl.constexpr, CVT_ASM: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    num_kv_heads = tl.num_programs(0)
    _idx, q_start_v, q_len_v, col_v, kv_end_v = load_table(info, S, S_POW2)
    live = q_len_v > 0
    rank = tl.cumsum(live.to(tl.int32), 0) - 1  # partial slot of each live segment
    r = tl.arange(0, BLOCK_M)
    g = r % GROUP
    d = tl.arange(0, HEAD_DIM)
    # at most min(T, S) live segments (their tokens are disjoint); the bound keeps a table that overlaps
    # itself (outside the contract) from writing past the workspace
    for j in range(0, tl.minimum(tl.sum(live.to(tl.int32), 0), tl.minimum(T, S))):
        hit = live & (rank == j)
        q_start = _pick(q_start_v, hit)
        q_len = _pick(q_len_v, hit)
        col = _pick(col_v, hit).to(tl.int64)
        kv_end = _pick(kv_end_v, hit)
        lo = first_key(q_len, kv_end, rows, window, CAUSAL)
        nb = (tl.maximum(kv_end - lo, 0) + BLOCK_N - 1) // BLOCK_N
        k0 = lo + ((p * nb) // P) * BLOCK_N
        k1 = tl.minimum(kv_end, lo + (((p + 1) * nb) // P) * BLOCK_N)
        i = r // GROUP  # query of each tile row
        token = q_start + i
        row_ok = (i < q_len) & (token >= 0) & (token < T)
        head = h * GROUP + g
        q_ptrs = q + token.to(tl.int64)[None, :, None] * stride_qt + head[None, :, None] * stride_qh + d[None, None, :]
        q_tile = tl.load(q_ptrs, mask=row_ok[None, :, None], other=0.0)
        if not QUANT:  # the dots run in the store's dtype
            q_tile = q_tile.to(k_store.dtype.element_ty)
        elif q_tile.dtype != tl.float32:  # e4m3 codes convert to fp16 cheaply (see sdpa_varlen_kernels)
            q_tile = q_tile.to(tl.float16)
        row_lo, row_hi = row_bounds(kv_end - q_len + i, row_ok, kv_end, rows, window, CAUSAL)
        full_lo, full_hi = full_bounds(q_len, kv_end, rows, window, 0, q_len - 1, CAUSAL)
        kv = col * stride_c + h.to(tl.int64) * stride_h
        sc = col * stride_sc + h.to(tl.int64) * stride_sh
        o, lse = attend(q_tile, k_store + kv, v_store + kv, k_scale + sc, v_scale + sc, stride_r, stride_h, stride_sr,
                        stride_sh, rows, k0, k1, row_lo, row_hi, full_lo, full_hi, qk_scale, 1, BLOCK_M, BLOCK_N,
                        HEAD_DIM, SKIP_MASKS, DOT_PREC, QUANT, CVT_ASM, 0, SECTOR, False)  # fmt: skip
        slot = ((j * num_kv_heads + h) * P + p).to(tl.int64) * BLOCK_M + r  # [BLOCK_M]
        tl.store(lse_part + slot, tl.reshape(lse, [BLOCK_M]))
        tl.store(o_part + slot[:, None] * HEAD_DIM + d[None, :], tl.reshape(o, [BLOCK_M, HEAD_DIM]))


@triton.jit
def splitkv_merge(out, o_part, lse_part, info, S, T, P, stride_ot, stride_oh, GROUP: tl.constexpr,
                  G_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, S_POW2: tl.constexpr,
                  MERGE_SLOTS: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    _idx, q_start_v, q_len_v, _cols, _ends = load_table(info, S, S_POW2)
    live = q_len_v > 0
    rank = tl.cumsum(live.to(tl.int32), 0) - 1
    hit = live & (q_start_v <= t) & (t < q_start_v + q_len_v)
    hits = tl.sum(hit.to(tl.int32), 0)  # 1 if a segment covers token t, else 0
    j = _pick(rank, hit)
    i = t - _pick(q_start_v, hit)  # the token's query index in its segment
    g = tl.arange(0, G_POW2)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, MERGE_SLOTS)[:, None]
    row = i * GROUP + g[None, :]  # [1, G_POW2] tile rows of this token
    # one covering segment (more only if the table overlaps itself), a slot and a row inside the workspace
    inside = (hits == 1) & (j < tl.minimum(T, S)) & (i * GROUP < BLOCK_M)
    ok = (g[None, :] < GROUP) & (g[None, :] * 0 + inside.to(tl.int32) > 0)
    m_i = tl.full([G_POW2], NEG_INF, tl.float32)
    l_i = tl.zeros([G_POW2], tl.float32)
    acc = tl.zeros([G_POW2, HEAD_DIM], tl.float32)
    base = (j * num_kv_heads + h).to(tl.int64) * P
    for c0 in range(0, P, MERGE_SLOTS):
        live_c = ok & (c0 + c < P)  # [SLOTS, G_POW2]
        slot = (base + c0 + c) * BLOCK_M + row
        lse = tl.load(lse_part + slot, mask=live_c, other=NEG_INF)
        o = tl.load(o_part + slot[:, :, None] * HEAD_DIM + d[None, None, :], mask=live_c[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m_i = m_new
    res = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)  # zeros: no key, no segment
    ptrs = out + t.to(tl.int64) * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, res.to(out.dtype.element_ty), mask=(g < GROUP)[:, None])


def split_merge(q, k_store, v_store, k_scale, v_scale, seq_info, out, args, strides, cfg, common, cvt_asm) -> None:
    """Launch both kernels for a step of T <= Q_SHORT tokens (every segment short). `args`, `strides`
    and `common` are `sdpa_varlen`'s; `cfg` the resolved config (its `programs` is P per KV head)."""
    num_segments, num_tokens, _rows, _window, _qk_scale = args
    num_kv_heads, head_dim, group = k_store.shape[2], q.shape[2], common["GROUP"]
    block_m = max(16, triton.next_power_of_2(num_tokens * group))
    programs = cfg.programs
    slots = min(num_tokens, num_segments) * num_kv_heads * programs * block_m
    lse_part = torch.empty(slots, dtype=torch.float32, device=q.device)
    o_part = torch.empty(slots * head_dim, dtype=torch.float32, device=q.device)
    stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh, stride_ot, stride_oh = strides
    s_pow2 = common["S_POW2"]
    splitkv_partials[(num_kv_heads, programs)](
        q, k_store, v_store, k_scale, v_scale, seq_info, o_part, lse_part, *args, stride_qt, stride_qh, stride_r,
        stride_c, stride_h, stride_sr, stride_sc, stride_sh, QUANT=common["QUANT"], CAUSAL=common["CAUSAL"],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=cfg.block_n, S_POW2=s_pow2,
        SKIP_MASKS=cfg.skip_masks, DOT_PREC=common["DOT_PREC"], SECTOR=32 // k_store.dtype.itemsize, CVT_ASM=cvt_asm,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    g_pow2 = triton.next_power_of_2(group)
    splitkv_merge[(num_tokens, num_kv_heads)](
        out, o_part, lse_part, seq_info, num_segments, num_tokens, programs, stride_ot, stride_oh, GROUP=group,
        G_POW2=g_pow2, HEAD_DIM=head_dim, BLOCK_M=block_m, S_POW2=s_pow2,
        MERGE_SLOTS=max(1, min(64, triton.next_power_of_2(programs), 8192 // (g_pow2 * head_dim))), num_warps=4,
    )  # fmt: skip
