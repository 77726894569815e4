"""`sdpa_varlen`'s split-KV variant for narrow steps (`SdpaConfig.split_merge`): two launches, no atomics.

For steps of at most Q_SHORT tokens (one or a few decoding or verifying sequences), where the
time is latency, not bandwidth: the stream-K kernel (`kernels`) locates each program's
blocks with a scan over the table and merges in the last program to finish an item (a fence, an
atomic, and a merge that starts only after the slowest program). Here instead:

- `splitkv_partials`, grid (Hkv, P): every live segment's key range is cut into P equal runs of
  whole BLOCK_N-key blocks, no scan: program p takes run (p + blocks of the live segments before)
  mod P of every live segment (at most T of them), so segments of like lengths put their longer
  runs on different programs. Each run's normalised fp32 output and log2-sum-exp go to the slots
  (token, KV head, p, group row) of its queries' rows only; an empty run writes lse = -inf.
- `splitkv_merge`, grid (T, Hq): one program per (token, query head) combines the P partials, or
  writes zeros for a token no segment covers (its slots are never read); a head's sink logit
  (SINKS) joins the row's normaliser here, once.

On sm_90+ (`SdpaConfig.pdl`) both are programmatic dependent launches (`ops/pdl.py`), so their
launch latency overlaps the grid before them (the K/V write, then the partials).

One segment's rows form one tile (q_len * G <= T * G rows, taken only while T * G <=
MAX_TILE_ROWS), so K and V are read once per group. Like the main path it trusts the table's
contents but writes nothing outside `out` and its workspace, whatever they hold. Graph-safe like
the main path: grids and workspace depend on T, S and P only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchkv.ops.kv_write_triton import _store_rows
from batchkv.ops.pdl import pdl_enter, pdl_kwargs
from batchkv.ops.sdpa.attend import attend
from batchkv.ops.sdpa.common import NEG_INF, full_bounds, load_table, q_for_dots, row_bounds, sink_logit, sink_share
from batchkv.ops.sdpa.kernels import _blocks


@triton.jit
def _pick(vec, hit):
    """The element of `vec` where the one-hot `hit` is set (0 where none is)."""
    return tl.sum(tl.where(hit, vec, 0), 0)


@triton.jit
def splitkv_partials(q, k_store, v_store, k_scale, v_scale, info, o_part, lse_part, S, T, rows, window, qk_scale,
                     stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh,
                     QUANT: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S_POW2: tl.constexpr, SKIP_MASKS: tl.constexpr,
                     DOT_PREC: tl.constexpr, SECTOR: tl.constexpr, CVT_ASM: tl.constexpr,
                     new_k, new_v, slots, W, columns, stride_nks, stride_nkh, stride_nvs, stride_nvh,
                     WRITE: tl.constexpr, W_POW2: tl.constexpr, GDC: tl.constexpr, cap2,
                     SOFTCAP: tl.constexpr, stride_vr, stride_vc, stride_vh, K_DIM: tl.constexpr,
                     V_TILE: tl.constexpr, V_DIM: tl.constexpr, SAME_STRIDES: tl.constexpr):  # fmt: skip
    if SAME_STRIDES:  # V laid out as K: K's offsets serve V (one set of 64-bit row offsets, as one width had)
        stride_vr = stride_r
        stride_vc = stride_c
        stride_vh = stride_h
    pdl_enter(GDC)  # launched early: wait until the grids before have finished (the K/V write, q)
    h = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    num_kv_heads = tl.num_programs(0)
    idx, _q_starts, q_len_v, _cols, kv_end_v = load_table(info, S, S_POW2)
    live = q_len_v > 0
    key = tl.where(live, tl.cumsum(live.to(tl.int32), 0) - 1, -1)  # rank of each live segment, -1 for the rest
    _lo_v, nb_v = _blocks(q_len_v, kv_end_v, rows, window, CAUSAL, BLOCK_N)
    nb_v = tl.where(live, nb_v, 0)
    before_v = tl.cumsum(nb_v, 0) - nb_v  # blocks of the live segments before each: staggers the runs
    r = tl.arange(0, BLOCK_M)
    g = r % GROUP
    d = tl.arange(0, HEAD_DIM)
    dv = tl.arange(0, V_TILE)
    # the step's K/V write, fused (only where K and V share their widths and strides): this program
    # stores head h of all W rows itself, then reads
    if WRITE:
        w = tl.arange(0, W_POW2)
        w_ok = w < W
        w_slot = tl.load(slots + w, mask=w_ok, other=0).to(tl.int64)
        w_row = w_slot // columns
        w_col = w_slot - w_row * columns
        w_dst = (w_row * stride_r + w_col * stride_c + h * stride_h)[:, None] + d[None, :]
        w_sdst = w_row * stride_sr + w_col * stride_sc + h * stride_sh
        k_rows = tl.load(new_k + w.to(tl.int64)[:, None] * stride_nks + h * stride_nkh + d[None, :],
                         mask=w_ok[:, None], other=0.0)  # fmt: skip
        v_rows = tl.load(new_v + w.to(tl.int64)[:, None] * stride_nvs + h * stride_nvh + d[None, :],
                         mask=w_ok[:, None], other=0.0)  # fmt: skip
        _store_rows(k_store, k_scale, k_rows, w_dst, w_ok[:, None], w_sdst, w_ok, QUANT)
        _store_rows(v_store, v_scale, v_rows, w_dst, w_ok[:, None], w_sdst, w_ok, QUANT)
        # Every program of head h writes the same codes and scales, so a row this program reads is one it
        # wrote before this barrier (which orders its threads' global writes before their reads).
        tl.debug_barrier()
    # at most min(T, S) live segments (their tokens are disjoint); the bound keeps a table that overlaps
    # itself (outside the contract) inside the loop's slots
    for j in range(0, tl.minimum(tl.sum(live.to(tl.int32), 0), tl.minimum(T, S))):
        hit = key == j
        seg = _pick(idx, hit)
        q_start = tl.load(info + seg * 4)
        q_len = tl.load(info + seg * 4 + 1)
        col = tl.load(info + seg * 4 + 2).to(tl.int64)
        kv_end = tl.load(info + seg * 4 + 3)
        lo, nb = _blocks(q_len, kv_end, rows, window, CAUSAL, BLOCK_N)
        # run u of this segment: shifted by the blocks before it, so that segments of like lengths spread
        # their long runs over different programs (the merge sums every run, whichever program ran it)
        u = (p + _pick(before_v, hit)) % P
        k0 = lo + ((u * nb) // P) * BLOCK_N
        k1 = tl.minimum(kv_end, lo + (((u + 1) * nb) // P) * BLOCK_N)
        i = r // GROUP  # query of each tile row
        token = q_start + i
        row_ok = (i < q_len) & (token >= 0) & (token < T)
        head = h * GROUP + g
        q_ptrs = q + token.to(tl.int64)[None, :, None] * stride_qt + head[None, :, None] * stride_qh + d[None, None, :]
        if K_DIM < HEAD_DIM:
            q_tile = tl.load(q_ptrs, mask=row_ok[None, :, None] & (d[None, None, :] < K_DIM), other=0.0)
        else:
            q_tile = tl.load(q_ptrs, mask=row_ok[None, :, None], other=0.0)
        q_tile = q_for_dots(q_tile, k_store.dtype.element_ty, QUANT)
        row_lo, row_hi = row_bounds(kv_end - q_len + i, row_ok, kv_end, rows, window, CAUSAL)
        full_lo, full_hi = full_bounds(q_len, kv_end, rows, window, 0, q_len - 1, CAUSAL)
        kv = col * stride_c + h.to(tl.int64) * stride_h
        kvv = col * stride_vc + h.to(tl.int64) * stride_vh
        sc = col * stride_sc + h.to(tl.int64) * stride_sh
        o, lse = attend(q_tile, k_store + kv, v_store + kvv, k_scale + sc, v_scale + sc, stride_r, stride_h, stride_sr,
                        stride_sh, rows, k0, k1, row_lo, row_hi, full_lo, full_hi, qk_scale, 1, BLOCK_M, BLOCK_N,
                        HEAD_DIM, SKIP_MASKS, DOT_PREC, QUANT, CVT_ASM, 0, SECTOR, False, cap2, SOFTCAP, stride_vr,
                        stride_vh, K_DIM, V_TILE, V_DIM)  # fmt: skip
        # partial slot (token, head, program, group row): only rows with a query are written
        slot = ((token.to(tl.int64) * num_kv_heads + h) * P + p) * GROUP + g
        tl.store(lse_part + slot, tl.reshape(lse, [BLOCK_M]), mask=row_ok)
        tl.store(o_part + slot[:, None] * V_TILE + dv[None, :], tl.reshape(o, [BLOCK_M, V_TILE]),
                 mask=row_ok[:, None])  # fmt: skip


@triton.jit
def splitkv_merge(out, o_part, lse_part, info, S, P, stride_ot, stride_oh, GROUP: tl.constexpr,
                  HEAD_DIM: tl.constexpr, S_POW2: tl.constexpr, MERGE_SLOTS: tl.constexpr,
                  GDC: tl.constexpr, sinks, SINKS: tl.constexpr, V_DIM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    hq = tl.program_id(1)  # query head: KV head hq // G, group row hq % G
    num_kv_heads = tl.num_programs(1) // GROUP
    _idx, q_start_v, q_len_v, _cols, _ends = load_table(info, S, S_POW2)
    hits = tl.sum(((q_len_v > 0) & (q_start_v <= t) & (t < q_start_v + q_len_v)).to(tl.int32), 0)
    # one covering segment wrote every slot of (t, head); none (or an overlapping table): zeros, nothing read
    covered = hits == 1
    if SINKS:  # a parameter no grid before writes: read while the partials kernel still runs
        sink = sink_logit(sinks, hq, covered)
    pdl_enter(GDC)  # launched early: the partials are complete and visible past here
    c = tl.arange(0, MERGE_SLOTS)
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([1], NEG_INF, tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    base = (t.to(tl.int64) * num_kv_heads + hq // GROUP) * P
    for c0 in range(0, P, MERGE_SLOTS):
        live = (c0 + c < P) & (c * 0 + covered.to(tl.int32) > 0)
        slot = (base + c0 + c) * GROUP + hq % GROUP
        lse = tl.load(lse_part + slot, mask=live, other=NEG_INF)
        o = tl.load(o_part + slot[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_i = m_new
    res = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)  # zeros: no key, or no segment
    if SINKS:  # the row's sink logit joins its normaliser once, here, after every partial
        res = res * sink_share(tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), NEG_INF), sink)
    # HEAD_DIM: the partials' columns (the value tile), of which the first V_DIM are the output's
    tl.store(
        out + t.to(tl.int64) * stride_ot + hq * stride_oh + d,
        res.to(out.dtype.element_ty),
        mask=(d < V_DIM) if V_DIM < HEAD_DIM else None,
    )


# (queries x group) rows of one segment's tile: taller tiles spill registers on sm_90 (D 128,
# bench/kernel_bench.py --compile-sm90 splitkv), e4m3 tiles (converted in registers) from 64 rows
MAX_TILE_ROWS = {False: 64, True: 32}  # by whether the store is e4m3


def takes_split_merge(num_tokens: int, group: int, cfg, quant: bool = False) -> bool:
    """Whether a step of `num_tokens` takes this path: `cfg.split_merge`, every segment short
    (T <= q_short), and a segment's rows fit one tile of at most MAX_TILE_ROWS[quant]."""
    return bool(cfg.split_merge) and num_tokens <= cfg.q_short and num_tokens * group <= MAX_TILE_ROWS[quant]


def split_merge(q, k_store, v_store, k_scale, v_scale, seq_info, out, args, strides, cfg, common, cvt_asm,
                launch: dict, write=None, extras: dict | None = None) -> None:  # fmt: skip
    """Launch both kernels for a step that `takes_split_merge`. `args`, `strides` and `common` are
    `sdpa_varlen`'s; `cfg` the resolved config (`programs` is P per KV head); `launch` the partials'
    launch options (warps, stages, register cap); `write`, checked by the caller, (k, v, slots) rows
    the partials kernel stores first (`sdpa_varlen`'s `write` with `fuse_write`), or None; `extras`
    the soft-cap and sink arguments (cap2, SOFTCAP, sinks, SINKS; default: neither)."""
    extras = extras or dict(cap2=0.0, SOFTCAP=False, sinks=q, SINKS=False)
    num_segments, num_tokens, _rows, _window, _qk_scale = args
    num_kv_heads, group = k_store.shape[2], common["GROUP"]
    v_tile = triton.next_power_of_2(v_store.shape[3])
    programs = cfg.programs
    pdl = pdl_kwargs(q.device, cfg.pdl)  # each launch overlaps the grid before it
    parts = num_tokens * num_kv_heads * programs * group  # (token, KV head, program, group row)
    lse_part = torch.empty(parts, dtype=torch.float32, device=q.device)
    o_part = torch.empty(parts * v_tile, dtype=torch.float32, device=q.device)
    stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc, stride_sh, stride_ot, stride_oh = strides
    s_pow2 = common["S_POW2"]
    new_k, new_v, slots = write if write is not None else (q, q, seq_info)  # unread without WRITE
    width = new_k.shape[0] if write is not None else 0
    splitkv_partials[(num_kv_heads, programs)](
        q, k_store, v_store, k_scale, v_scale, seq_info, o_part, lse_part, *args, stride_qt, stride_qh, stride_r,
        stride_c, stride_h, stride_sr, stride_sc, stride_sh, QUANT=common["QUANT"], CAUSAL=common["CAUSAL"],
        GROUP=group, HEAD_DIM=common["HEAD_DIM"], BLOCK_M=max(16, triton.next_power_of_2(num_tokens * group)),
        BLOCK_N=cfg.block_n, S_POW2=s_pow2, SKIP_MASKS=cfg.skip_masks, DOT_PREC=common["DOT_PREC"],
        SECTOR=32 // k_store.dtype.itemsize, CVT_ASM=cvt_asm, new_k=new_k, new_v=new_v, slots=slots, W=width,
        columns=k_store.shape[1], stride_nks=new_k.stride(0), stride_nkh=new_k.stride(1), stride_nvs=new_v.stride(0),
        stride_nvh=new_v.stride(1), WRITE=width > 0, W_POW2=triton.next_power_of_2(max(width, 1)), **launch, **pdl,
        cap2=extras["cap2"], SOFTCAP=extras["SOFTCAP"], stride_vr=v_store.stride(0),
        stride_vc=v_store.stride(0) if v_store.shape[1] == 1 else v_store.stride(1), stride_vh=v_store.stride(2),
        K_DIM=common["K_DIM"], V_TILE=v_tile, V_DIM=v_store.shape[3], SAME_STRIDES=common["SAME_STRIDES"],
    )  # fmt: skip
    splitkv_merge[(num_tokens, num_kv_heads * group)](
        out, o_part, lse_part, seq_info, num_segments, programs, stride_ot, stride_oh, GROUP=group,
        HEAD_DIM=v_tile, S_POW2=s_pow2, MERGE_SLOTS=min(64, triton.next_power_of_2(programs)), num_warps=4,
        **pdl, sinks=extras["sinks"], SINKS=extras["SINKS"], V_DIM=v_store.shape[3],
    )  # fmt: skip
