"""Device code of `sdpa_varlen`'s split path: decode and verify steps in one launch.

`split_kernel`, grid (Hkv / HEADS, P): split-K (flash-decoding) for *short* segments, 0 < q_len <=
Q_SHORT, with the merge done by the last program to finish each item, and the zeroing of rows no
segment covers. Long segments (prefill) are `long_kernel`'s (`long.py`).

- Tiles: a program serves HEADS KV heads at once, [HEADS, BLOCK_M, D] query tiles against
  [HEADS, BLOCK_N, D] key tiles (batched dots), so each key row it reads is HEADS * D contiguous
  elements. Widths: keys K_DIM in tiles of HEAD_DIM columns, values V_DIM in tiles of V_TILE (each
  the next power of two; the columns past a width masked: 192-wide keys beside 128-wide values).
  Row r of a head's tile is query qb*BLOCK_Q + r // G of the segment, query head
  (h*G + r % G); BLOCK_M >= 16 pads BLOCK_Q * G for tl.dot.
- Work: a short segment is cut into query blocks of BLOCK_Q queries; each is an *item* whose work
  is the segment's key range [first key, kv_end) in BLOCK_N-key blocks. All items end to end form
  one axis of W blocks, and program p < P_eff = clamp(W // MIN_BLOCKS, 1, P) takes blocks
  [p*W//P_eff, (p+1)*W//P_eff) (stream-K): equal work per program whatever the mix of lengths, in
  one wave. Program p holds block x iff p == ((x+1)*P_eff - 1) // W.
- Finishing an item: the programs that share an item know how many they are. A sole program
  writes `out` itself. Otherwise each writes its normalised fp32 output and log2-sum-exp to
  partial slot `p + item` (unique), then adds 1 to the item's counter (acq_rel, gpu scope, after a
  CTA barrier so every thread's stores are ordered before it); the one that sees count-1 reads all
  the item's partials (`merge.py`), writes `out`, and stores 0 back. Counters are
  therefore zero after every launch (graph replays need no memset); the workspace must not be
  shared by two launches running at once (the launcher keeps one per device; batchkv attends on
  one stream).
- Rows: program P-1-p of a head group zeroes rows t = p, p + P, ... that no segment writes (its
  heads only), so padding rows are exact zeros without another launch. When the written rows are
  one run (a packed step: their lengths sum to the span they cover) those are the rows before and
  after it; otherwise each row is tested against the whole table.
- Few-row variants (off by default): WARP_SPLIT cuts each key tile across warps, one softmax
  state per warp (`warp_split.py`); PREFETCH asks the L2 for the blocks ahead
  (`prefetch_keys`), a piece's first ones before q is loaded.

- Soft-capping and sinks (constexpr SOFTCAP, SINKS; off: the code is unchanged): the tile loop
  caps each score (`soft_cap`); a sink changes only a row's normaliser, so it is applied once per
  row where the row's output is final, by `sink_weight` of its lse over all its keys: by the sole
  program of an item, or in the merge (partials are normalised over their own keys only).
- e4m3 stores (QUANT): the tile loop (`attend.attend`) reads codes as int16 pairs and
  converts them in registers to fp16 (fp32 for fp32 queries), so the dots run on 16-bit operands
  in their native layouts; per tile one [BLOCK_N] vector of K scales (times qk_scale) multiplies
  the score columns and one of V scales multiplies p before the PV dot, so l_i sums p without the
  scales and acc sums p * scale * code (both 2^P_SHIFT times larger: fp16 range). Accumulation is fp32.

Only interior key blocks (every row of the tile attends every key) skip the mask. The plan is
derived on the device from one [S, 4] table load, one int64 scan and one reduction per program
(its first block's segment); from there a program follows the table row by row, so no
S-long vector stays in registers through the tile loop. Given the count of live rows (TABLE_CHUNK <
S_POW2: `sdpa_varlen(live=)`, a table longer than the chunk) the plan reads only those: as a
TABLE_CHUNK-row table when they fit, else in the whole table's shape masked at the count, one table
load after the count's (a mixed step's table is as long as its width allows, its live rows as many
as its sequences). No length reaches the host. The kernel trusts the table's contents but never
writes outside `out` and its workspace, whatever they hold.
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchkv.ops.pdl import pdl_enter
from batchkv.ops.sdpa.attend import attend
from batchkv.ops.sdpa.common import (
    first_key,
    full_bounds,
    load_table,
    prefetch_keys,
    q_for_dots,
    row_bounds,
    sink_weight,
)
from batchkv.ops.sdpa.merge import merge_partials
from batchkv.ops.sdpa.warp_split import attend_warp_split

ITEM_SHIFT = tl.constexpr(40)  # packed scan: items above bit 40, key blocks below
LOW_MASK = tl.constexpr((1 << 40) - 1)


@triton.jit
def _blocks(q_len, kv_end, rows, window, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key, key blocks) of a segment's range [first key, kv_end)."""
    lo = first_key(q_len, kv_end, rows, window, CAUSAL)
    return lo, (tl.maximum(kv_end - lo, 0) + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _items(q_len, kv_end, rows, window, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
           Q_SHORT: tl.constexpr):  # fmt: skip
    """(first key, key blocks, items) of segments, vectors or scalars alike: a short segment with keys
    has one item per query block; a long or empty one none."""
    lo, nblk = _blocks(q_len, kv_end, rows, window, CAUSAL, BLOCK_N)
    return lo, nblk, tl.where((q_len > 0) & (q_len <= Q_SHORT) & (nblk > 0), (q_len + BLOCK_Q - 1) // BLOCK_Q, 0)


@triton.jit
def _locate_combine(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), tl.maximum(a2, b2)


@triton.jit
def _cover_combine(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)


@triton.jit
def _store_zeros(out, t, blank, zeros, col_off, head_ok, stride_ot):
    """Zeros into rows t (those `blank`), the columns of `col_off` that `head_ok`."""
    ptrs = out + t.to(tl.int64)[:, None] * stride_ot + col_off[None, :]
    tl.store(ptrs, zeros, mask=blank[:, None] & head_ok[None, :])


@triton.jit
def _writes(q_len_v, nq_v, LONG: tl.constexpr, Q_SHORT: tl.constexpr):
    """Segments whose rows some program writes: a short one's items, a long one's kernel when it runs."""
    if LONG:
        return (nq_v > 0) | (q_len_v > Q_SHORT)
    return nq_v > 0


@triton.jit
def _cover(q_start_v, q_len_v, writes_v, T):
    """(rows written, first written row, past the last) of the written segments."""
    return tl.reduce((tl.where(writes_v, q_len_v, 0), tl.where(writes_v, q_start_v, T),
                      tl.where(writes_v, q_start_v + q_len_v, 0)), 0, _cover_combine)  # fmt: skip


@triton.jit
def _plan(info, n, p, P, T, rows, window, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
          Q_SHORT: tl.constexpr, LONG: tl.constexpr, MIN_BLOCKS: tl.constexpr, AXIS64: tl.constexpr,
          ROWS: tl.constexpr):  # fmt: skip
    """Program p's plan from the table's rows [0, n) (n <= ROWS, a power of two), read by one [ROWS, 4]
    load: the work axis's W key blocks, the P_eff programs that share them, p's blocks [x, b1), block x's
    segment s with that segment's first block and first item, and the written rows (count, first, end)."""
    _idx, q_start_v, q_len_v, _cols, kv_end_v = load_table(info, n, ROWS)
    _lo, nblk, nq_v = _items(q_len_v, kv_end_v, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT)
    packed = tl.cumsum((nq_v.to(tl.int64) << ITEM_SHIFT) | (nq_v * nblk).to(tl.int64), 0)
    w_end = packed & LOW_MASK  # inclusive cumsum of key blocks
    item_end = packed >> ITEM_SHIFT  # inclusive cumsum of items
    W = tl.max(w_end, 0)
    if not AXIS64:  # the launcher's bound says W * P < 2^31: 32-bit divisions (64-bit ones are calls)
        W = W.to(tl.int32)
        w_end = w_end.to(tl.int32)
        item_end = item_end.to(tl.int32)
    P_eff = tl.maximum(tl.minimum(W // MIN_BLOCKS, P), 1)  # each program gets >= MIN_BLOCKS blocks
    x = (p * W) // P_eff
    b1 = tl.where(p < P_eff, ((p + 1) * W) // P_eff, x)
    before = w_end <= x  # segments wholly before block x
    s, w_start, it_start = tl.reduce((before.to(tl.int32), tl.where(before, w_end, 0),
                                      tl.where(before, item_end, 0)), 0, _locate_combine)  # fmt: skip
    written, lo, hi = _cover(q_start_v, q_len_v, _writes(q_len_v, nq_v, LONG, Q_SHORT), T)
    return W, P_eff, x, b1, s, w_start, it_start, written, lo, hi


@triton.jit
def _zero_uncovered(out, p, P, T, h0, written, lo, hi, info, n, rows, window, stride_ot, stride_oh,
                    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, Q_SHORT: tl.constexpr,
                    LONG: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr,
                    V_TILE: tl.constexpr, HG_POW2: tl.constexpr, ZERO_ROWS: tl.constexpr,
                    V_DIM: tl.constexpr):  # fmt: skip
    """Exact zeros in rows t = p, p + P, ... < T that no segment writes, query heads of this program
    (V_DIM output columns each, in tiles of V_TILE). When the written rows are one run [lo, hi) (the
    engine's packed steps: segments never overlap, so their lengths summing to the span says so), the
    zeros are the rows before and after it, with no per-row test; otherwise each row is tested
    against every segment of the table's rows [0, n), read CHUNK at a time. (Overlapping segments,
    outside the contract, may leave a gap unwritten.)"""
    c = tl.arange(0, HG_POW2 * V_TILE)
    head = h0 * GROUP + c // V_TILE  # query head of each column
    head_ok = (c // V_TILE) < HEADS * GROUP
    if V_DIM < V_TILE:
        head_ok = head_ok & (c % V_TILE < V_DIM)
    col_off = head.to(tl.int64) * stride_oh + c % V_TILE
    zeros = tl.zeros([ZERO_ROWS, HG_POW2 * V_TILE], out.dtype.element_ty)
    if (written == hi - lo) | (written == 0):  # one run (none: lo = T, every row is before it)
        for t0 in range(p, tl.minimum(lo, T), P * ZERO_ROWS):  # the rows before the run
            t = t0 + P * tl.arange(0, ZERO_ROWS)
            _store_zeros(out, t, (t < lo) & (t < T), zeros, col_off, head_ok, stride_ot)
        first = tl.maximum(tl.maximum(hi, lo), 0)  # (none written: every row was before the run)
        for t0 in range(first + (p - first % P + P) % P, T, P * ZERO_ROWS):  # and after it (rows t = p mod P)
            t = t0 + P * tl.arange(0, ZERO_ROWS)
            _store_zeros(out, t, t < T, zeros, col_off, head_ok, stride_ot)
    else:
        for t0 in range(p, T, P * ZERO_ROWS):
            t = t0 + P * tl.arange(0, ZERO_ROWS)
            hits = t * 0
            for c0 in range(0, n, CHUNK):
                _idx, q_start_v, q_len_v, _cols, kv_end_v = load_table(info, n, CHUNK, c0)
                _lo, _nblk, nq_v = _items(q_len_v, kv_end_v, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT)
                # [CHUNK, ZERO_ROWS], segments along the table's own layout (no conversion of the table)
                hit = (q_start_v[:, None] <= t[None, :]) & (t[None, :] < (q_start_v + q_len_v)[:, None])
                hits += tl.max((hit & _writes(q_len_v, nq_v, LONG, Q_SHORT)[:, None]).to(tl.int32), 0)
            _store_zeros(out, t, (hits == 0) & (t < T), zeros, col_off, head_ok, stride_ot)


@triton.jit
def split_kernel(q, k_store, v_store, k_scale, v_scale, info, live, out, o_part, lse_part, counters, S, T, rows, window,
                 qk_scale, P, MAX_ITEMS, stride_qt, stride_qh, stride_r, stride_c, stride_h, stride_sr, stride_sc,
                 stride_sh, stride_ot, stride_oh, QUANT: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr,
                 HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, Q_SHORT: tl.constexpr,
                 S_POW2: tl.constexpr, MIN_BLOCKS: tl.constexpr, LONG: tl.constexpr, SKIP_MASKS: tl.constexpr,
                 MERGE_ROWS: tl.constexpr, MERGE_SLOTS: tl.constexpr, HG_POW2: tl.constexpr,
                 ZERO_ROWS: tl.constexpr, AXIS64: tl.constexpr, DOT_PREC: tl.constexpr, WARP_SPLIT: tl.constexpr,
                 PREFETCH: tl.constexpr, SECTOR: tl.constexpr, PREFETCH_CHECK: tl.constexpr,
                 MERGE_STAGES: tl.constexpr, CVT_ASM: tl.constexpr, cap2, sinks, SOFTCAP: tl.constexpr,
                 SINKS: tl.constexpr, stride_vr, stride_vc, stride_vh, K_DIM: tl.constexpr, V_TILE: tl.constexpr,
                 V_DIM: tl.constexpr, SAME_STRIDES: tl.constexpr, GDC: tl.constexpr,
                 TABLE_CHUNK: tl.constexpr):  # fmt: skip
    if SAME_STRIDES:  # V laid out as K: K's offsets serve V (one set of 64-bit row offsets, as one width had)
        stride_vr = stride_r
        stride_vc = stride_c
        stride_vh = stride_h
    hp = tl.program_id(0)  # head group: KV heads h0 .. h0 + HEADS - 1
    p = tl.program_id(1)
    h0 = hp * HEADS
    num_kv_heads = tl.num_programs(0) * HEADS
    # block x's segment s, its first block and first item, found once in the table; then followed row by row
    # (the table's columns die in `_plan`: the loop below keeps scalars, not long vectors, in registers)
    n = S  # rows read: the table's, or its live ones
    if TABLE_CHUNK == S_POW2:  # the whole table
        W, P_eff, x, b1, s, w_start, it_start, written, lo, hi = _plan(
            info, S, p, P, T, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT, LONG, MIN_BLOCKS, AXIS64, S_POW2
        )
    else:  # its live rows: as a TABLE_CHUNK-row table when they fit, else as the whole table's
        n = tl.minimum(tl.load(live), S)
        if n <= TABLE_CHUNK:
            W, P_eff, x, b1, s, w_start, it_start, written, lo, hi = _plan(
                info, n, p, P, T, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT, LONG, MIN_BLOCKS, AXIS64,
                TABLE_CHUNK)  # fmt: skip
        else:
            W, P_eff, x, b1, s, w_start, it_start, written, lo, hi = _plan(
                info, n, p, P, T, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT, LONG, MIN_BLOCKS, AXIS64, S_POW2
            )
    # launched early (GDC): the plan above reads only the table, which no grid of the step writes; from here
    # on (q, the K/V the write before stored, `out`, the workspace) the grids before have finished
    pdl_enter(GDC)

    # the last programs zero: when the work is short (P_eff < P) they are the idle ones
    _zero_uncovered(out, P - 1 - p, P, T, h0, written, lo, hi, info, n, rows, window, stride_ot, stride_oh, CAUSAL,
                    BLOCK_N, BLOCK_Q, Q_SHORT, LONG, TABLE_CHUNK, GROUP, HEADS, V_TILE, HG_POW2, ZERO_ROWS,
                    V_DIM)  # fmt: skip

    hh = tl.arange(0, HEADS)[:, None, None]
    d = tl.arange(0, HEAD_DIM)[None, None, :]  # query and key columns (those from K_DIM on: padding)
    dv = tl.arange(0, V_TILE)[None, None, :]  # value and output columns (from V_DIM on: padding)
    r3 = tl.arange(0, BLOCK_M)[None, :, None]
    g = tl.arange(0, BLOCK_M) % GROUP
    while x < b1:
        q_start = tl.load(info + s * 4)
        q_len = tl.load(info + s * 4 + 1)
        col = tl.load(info + s * 4 + 2).to(tl.int64)
        kv_end = tl.load(info + s * 4 + 3)
        lo, nb, nq = _items(q_len, kv_end, rows, window, CAUSAL, BLOCK_N, BLOCK_Q, Q_SHORT)
        seg_end = w_start + nq * nb  # the segment's blocks: [w_start, seg_end)
        if x < seg_end:
            qb = (x - w_start).to(tl.int32) // nb  # query block of the segment
            it = it_start + qb  # item index
            off = w_start + qb * nb  # the item's blocks: [off, off + nb)
            piece_end = tl.minimum(off + nb, b1)
            p_first = ((off + 1) * P_eff - 1) // W
            p_last = ((off + nb) * P_eff - 1) // W
            k0 = lo + ((x - off) * BLOCK_N).to(tl.int32)
            k1 = tl.minimum(kv_end, lo + ((piece_end - off) * BLOCK_N).to(tl.int32))

            kv = col * stride_c + h0.to(tl.int64) * stride_h  # (column, first KV head)
            kvv = col * stride_vc + h0.to(tl.int64) * stride_vh  # the same in the V store
            trip = 0.0
            if PREFETCH > 0:  # the piece's first blocks, before q is loaded: HBM starts streaming at once
                for a in range(k0, tl.minimum(k1, k0 + PREFETCH * BLOCK_N), BLOCK_N):
                    trip += prefetch_keys(k_store + kv, v_store + kv, stride_r, stride_h, rows, k0, a, k1, BLOCK_N,
                                          HEADS, HEAD_DIM, SECTOR, PREFETCH_CHECK)  # fmt: skip

            i = qb * BLOCK_Q + tl.arange(0, BLOCK_M) // GROUP  # query of each tile row
            token = q_start + i
            row_ok = (tl.arange(0, BLOCK_M) < BLOCK_Q * GROUP) & (i < q_len) & (token >= 0) & (token < T)
            head = (h0 + hh) * GROUP + g[None, :, None]  # [HEADS, BLOCK_M, 1] query heads
            q_ptrs = q + token.to(tl.int64)[None, :, None] * stride_qt + head * stride_qh + d
            if K_DIM < HEAD_DIM:
                q_tile = tl.load(q_ptrs, mask=row_ok[None, :, None] & (d < K_DIM), other=0.0)
            else:
                q_tile = tl.load(q_ptrs, mask=row_ok[None, :, None], other=0.0)
            q_tile = q_for_dots(q_tile, k_store.dtype.element_ty, QUANT)
            if PREFETCH_CHECK:
                q_tile += trip.to(q_tile.dtype)  # NaN when a prefetch named a row outside the resident keys
            row_lo, row_hi = row_bounds(kv_end - q_len + i, row_ok, kv_end, rows, window, CAUSAL)
            i_last = tl.minimum(q_len, qb * BLOCK_Q + BLOCK_Q) - 1
            full_lo, full_hi = full_bounds(q_len, kv_end, rows, window, qb * BLOCK_Q, i_last, CAUSAL)
            sc = col * stride_sc + h0.to(tl.int64) * stride_sh  # the first KV head's scales
            if WARP_SPLIT > 1:  # (HEADS == 1)
                o, lse = attend_warp_split(q_tile, k_store + kv, v_store + kv, k_scale + sc, v_scale + sc,
                                           stride_r, stride_sr, rows, k0, k1, row_lo, row_hi, full_lo, full_hi,
                                           qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, WARP_SPLIT, SKIP_MASKS, DOT_PREC,
                                           QUANT, CVT_ASM, PREFETCH, SECTOR, PREFETCH_CHECK, cap2,
                                           SOFTCAP)  # fmt: skip
            else:
                o, lse = attend(q_tile, k_store + kv, v_store + kvv, k_scale + sc, v_scale + sc, stride_r, stride_h,
                                stride_sr, stride_sh, rows, k0, k1, row_lo, row_hi, full_lo, full_hi, qk_scale, HEADS,
                                BLOCK_M, BLOCK_N, HEAD_DIM, SKIP_MASKS, DOT_PREC, QUANT, CVT_ASM, PREFETCH, SECTOR,
                                PREFETCH_CHECK, cap2, SOFTCAP, stride_vr, stride_vh, K_DIM, V_TILE, V_DIM)  # fmt: skip
            out_ptrs = out + token.to(tl.int64)[None, :, None] * stride_ot + head * stride_oh + dv
            out_ok = row_ok[None, :, None] & (dv < V_DIM) if V_DIM < V_TILE else row_ok[None, :, None]
            if p_first == p_last:  # the item is this program's alone
                if SINKS:  # its lse covers every key of the row: the sink's share comes off here
                    o = o * sink_weight(lse[:, :, None], sinks, head, row_ok[None, :, None])
                tl.store(out_ptrs, o.to(out.dtype.element_ty), mask=out_ok)
            elif it < MAX_ITEMS:  # (always, unless the table overlaps itself)
                row = ((p + it).to(tl.int64) * num_kv_heads + h0 + hh) * BLOCK_M + r3  # partial slot p + item
                tl.store(lse_part + row, lse[:, :, None], mask=row_ok[None, :, None])
                tl.store(o_part + row * V_TILE + dv, o, mask=row_ok[None, :, None])
                tl.debug_barrier()  # every thread's partial stores precede the release below
                counter = counters + it * tl.num_programs(0) + hp
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == p_last - p_first:  # the last to finish: every other partial is visible
                    merge_partials(out, o_part, lse_part, it, p_first, p_last, h0, num_kv_heads, q_start, q_len, qb,
                                   T, stride_ot, stride_oh, GROUP, HEADS, V_TILE, BLOCK_M, BLOCK_Q, MERGE_ROWS,
                                   MERGE_SLOTS, MERGE_STAGES, sinks, SINKS, V_DIM)  # fmt: skip
                    tl.store(counter, 0)  # self-cleaning: the next launch finds zeros
            x = piece_end
        next_row = x >= seg_end  # the segment's last item is done (or it has none): on to the next row
        s = tl.where(next_row, s + 1, s)
        w_start = tl.where(next_row, seg_end, w_start)
        it_start = tl.where(next_row, it_start + nq, it_start)
