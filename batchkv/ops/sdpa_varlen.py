"""sdpa_varlen: attention of packed queries over the column store, in Triton, capturable.

Contract (same as `sdpa_varlen_reference`): for each row s of `seq_info` = (q_start, q_len, col,
kv_end), query i of the segment is packed row `q_start + i` at position `p_i = kv_end - q_len + i`;
causal rows attend keys [lo_i, p_i], non-causal rows [lo, kv_end); a window trims lo; only
t >= kv_end - rows is resident and key t lives at store[t % rows, col]. GQA: query head
h*G + g reads KV head h (G = Hq // Hkv). Uncovered rows and rows with no key come out as zeros.

Three launches, every grid sized from static extents only (T, S, Hkv, the SM count):

1. `_split_kernel`, grid (Hkv, P): split-K (flash-decoding) for *short* segments
   (0 < q_len <= q_short). A short segment is cut into query blocks of BLOCK_Q queries (so a
   tile is BLOCK_Q * G (query, head) rows, padded to BLOCK_M >= 16 for tl.dot); each query block
   is an *item* whose work is the segment's key range in BLOCK_N-key blocks. All items laid end to
   end form one axis of W key blocks, and program p takes blocks [p*W//P, (p+1)*W//P): every
   program gets the same work (within one block) whatever the length mix (stream-K). A program's
   range may cross item boundaries; each (program, item) piece writes an fp32 partial (normalised
   output + log2-sum-exp) into slot `p + item`, unique because both grow along the axis.
   P is a persistent grid (about `occupancy` programs per SM over all KV heads), so short and
   long mixes alike finish in one wave; idle programs exit after reading the table.
2. `_long_kernel`, grid (cdiv(T, BLOCK_Q') + S', Hkv): one program per query block of a *long*
   segment (q_len > q_short), no split (prefill chunks have rows enough). Launched only when
   T > q_short, since otherwise no segment can be long.
3. `_merge_kernel`, grid (T, Hkv): finds each row's segment by scanning `seq_info` (S is small),
   writes zeros for uncovered rows, merges the partials of short rows (recomputing the same
   plan), and leaves long rows to kernel 2. Zeroing costs no launch of its own.

Every program recomputes the plan from `seq_info` on the device (a cumsum over S entries), so
the host never reads a length: the call captures into a CUDA graph and replays correctly after
`seq_info` changes. Inside kernels the names follow FlashAttention: m_i (running max), l_i
(running sum), acc, alpha (rescale), lse; scores use exp2 with 1/ln2 folded into the scale.
Store offsets are int64 (rows * C * Hkv * D can pass 2^31). fp32 storage uses IEEE dots so the
interpreter and the GPU agree; bf16/fp16 use tensor cores with fp32 accumulation. q is cast to
the store dtype for the QK dot. Block sizes, warps, stages and P are in `SdpaConfig` (defaults
from a static heuristic: no autotuning, whose first-call benchmarking does not mix with capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from batchkv.errors import ContractError

LOG2E = 1.4426950408889634  # 1/ln(2)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- device helpers (inlined) ---------------------------------------------------------------
@triton.jit
def _pick(vec, idx, s):
    """vec[s] of a [S_POW2] vector, as a scalar."""
    return tl.sum(tl.where(idx == s, vec, 0), 0)


@triton.jit
def _find(ends, x):
    """Index of the first entry of an inclusive cumsum `ends` that is > x."""
    return tl.sum((ends <= x).to(tl.int32), 0)


@triton.jit
def _segments(info, S, rows, window, CAUSAL: tl.constexpr, S_POW2: tl.constexpr):
    """Per-segment vectors [S_POW2]: q_start, q_len, kv_end and the union key range [lo, hi)."""
    idx = tl.arange(0, S_POW2)
    ok = idx < S
    q_start = tl.load(info + idx * 4, mask=ok, other=0)
    q_len = tl.load(info + idx * 4 + 1, mask=ok, other=0)
    kv_end = tl.load(info + idx * 4 + 3, mask=ok, other=0)
    lo = tl.maximum(kv_end - rows, 0)  # oldest resident key
    if CAUSAL:
        lo = tl.where(window > 0, tl.maximum(lo, kv_end - q_len - window + 1), lo)  # first query's window
    else:
        lo = tl.where(window > 0, tl.maximum(lo, kv_end - window), lo)
    return idx, q_start, q_len, kv_end, lo


@triton.jit
def _short_plan(q_len, kv_end, lo, Q_SHORT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """Items of the split kernel: nq query blocks per short segment, each nblk key blocks wide."""
    nblk = (tl.maximum(kv_end - lo, 0) + BLOCK_N - 1) // BLOCK_N
    nq = tl.where((q_len > 0) & (q_len <= Q_SHORT) & (nblk > 0), (q_len + BLOCK_Q - 1) // BLOCK_Q, 0)
    item_end = tl.cumsum(nq, 0)  # inclusive: items of segments [0, s]
    w_end = tl.cumsum(nq * nblk, 0)  # inclusive: key blocks of segments [0, s]
    return nblk, nq, item_end, w_end


@triton.jit
def _item_at(x, idx, nblk, nq, item_end, w_end):
    """Global item index holding key block x of the work axis."""
    s = _find(w_end, x)
    nb = _pick(nblk, idx, s)
    base = _pick(w_end - nq * nblk, idx, s)
    return _pick(item_end - nq, idx, s) + (x - base) // nb


@triton.jit
def _query_tile(
    q,
    q_start,
    q_len,
    kv_end,
    qb,
    h,
    T,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Tile of (query, group head) rows r -> query qb*BLOCK_Q + r // G, head h*G + r % G."""
    r = tl.arange(0, BLOCK_M)
    i = qb * BLOCK_Q + r // GROUP
    token = q_start + i
    row_ok = (r < BLOCK_Q * GROUP) & (i < q_len) & (token < T)
    d = tl.arange(0, HEAD_DIM)
    ptrs = q + token.to(tl.int64)[:, None] * stride_qt + (h * GROUP + r % GROUP)[:, None] * stride_qh + d[None, :]
    tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tile, row_ok, token, kv_end - q_len + i  # positions p_i


@triton.jit
def _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL: tl.constexpr):
    """Keys each row may attend: [row_lo, row_hi); empty for padding rows."""
    lo = tl.maximum(kv_end - rows, 0)
    if CAUSAL:
        row_lo = tl.where(window > 0, tl.maximum(lo, pos - window + 1), lo)
        row_hi = pos + 1
    else:
        row_lo = tl.where(window > 0, tl.maximum(lo, kv_end - window), lo) + 0 * pos
        row_hi = kv_end + 0 * pos
    return row_lo, tl.where(row_ok, row_hi, row_lo)


@triton.jit
def _attend(
    q_tile,
    k_base,
    v_base,
    stride_kr,
    stride_vr,
    rows,
    k0,
    k1,
    row_lo,
    row_hi,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online softmax of a query tile over keys [k0, k1) of one (column, KV head)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    for start in range(k0, k1, BLOCK_N):
        t = start + offs_n  # key positions
        in_range = t < k1
        r = (t % rows).to(tl.int64)  # ring row of each key
        k = tl.load(k_base + r[:, None] * stride_kr + d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
        allowed = (t[None, :] >= row_lo[:, None]) & (t[None, :] < row_hi[:, None]) & in_range[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + r[:, None] * stride_vr + d[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _split_kernel(
    q,
    k_store,
    v_store,
    info,
    o_part,
    lse_part,
    S,
    T,
    rows,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_kc,
    stride_kh,
    stride_vr,
    stride_vc,
    stride_vh,
    P,
    SLOTS,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_SHORT: tl.constexpr,
    S_POW2: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    h = tl.program_id(0)
    p = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    idx, q_start_v, q_len_v, kv_end_v, lo_v = _segments(info, S, rows, window, CAUSAL, S_POW2)
    nblk, nq, item_end, w_end = _short_plan(q_len_v, kv_end_v, lo_v, Q_SHORT, BLOCK_Q, BLOCK_N)
    W = tl.sum(nq * nblk, 0).to(tl.int64)
    b0 = (p * W) // P  # this program's key blocks [b0, b1) of the work axis
    b1 = ((p + 1) * W) // P
    if b0 >= b1:
        return
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    for it in range(_item_at(b0, idx, nblk, nq, item_end, w_end), _item_at(b1 - 1, idx, nblk, nq, item_end, w_end) + 1):
        s = _find(item_end, it)
        qb = it - _pick(item_end - nq, idx, s)
        nb = _pick(nblk, idx, s)
        off = _pick(w_end - nq * nblk, idx, s) + qb * nb  # the item's first block on the axis
        q_len = _pick(q_len_v, idx, s)
        kv_end = _pick(kv_end_v, idx, s)
        lo = _pick(lo_v, idx, s)
        k0 = lo + (tl.maximum(off, b0) - off).to(tl.int32) * BLOCK_N
        k1 = tl.minimum(kv_end, lo + (tl.minimum(off + nb, b1) - off).to(tl.int32) * BLOCK_N)
        q_tile, row_ok, _token, pos = _query_tile(
            q,
            _pick(q_start_v, idx, s),
            q_len,
            kv_end,
            qb,
            h,
            T,
            stride_qt,
            stride_qh,
            GROUP,
            BLOCK_Q,
            BLOCK_M,
            HEAD_DIM,
        )
        q_tile = q_tile.to(k_store.dtype.element_ty)
        row_lo, row_hi = _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL)
        col = tl.load(info + s * 4 + 2).to(tl.int64)
        acc, m_i, l_i = _attend(
            q_tile,
            k_store + col * stride_kc + h * stride_kh,
            v_store + col * stride_vc + h * stride_vh,
            stride_kr,
            stride_vr,
            rows,
            k0,
            k1,
            row_lo,
            row_hi,
            qk_scale,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            DOT_PREC,
        )
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        row = ((p + it).to(tl.int64) * num_kv_heads + h) * BLOCK_M + r  # partial slot p + item
        fits = (p + it + 0 * r) < SLOTS  # always, unless the table overlaps itself (then no stray write)
        tl.store(lse_part + row, lse, mask=fits)
        tl.store(o_part + row[:, None] * HEAD_DIM + d[None, :], o, mask=fits[:, None])


@triton.jit
def _long_kernel(
    q,
    k_store,
    v_store,
    info,
    out,
    S,
    T,
    rows,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_kc,
    stride_kh,
    stride_vr,
    stride_vc,
    stride_vh,
    stride_ot,
    stride_oh,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_SHORT: tl.constexpr,
    S_POW2: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    idx, q_start_v, q_len_v, kv_end_v, _lo_v = _segments(info, S, rows, window, CAUSAL, S_POW2)
    nlb = tl.where(q_len_v > Q_SHORT, (q_len_v + BLOCK_Q - 1) // BLOCK_Q, 0)  # query blocks of long segments
    ends = tl.cumsum(nlb, 0)
    if pid >= tl.sum(nlb, 0):
        return
    s = _find(ends, pid)
    qb = pid - _pick(ends - nlb, idx, s)
    q_len = _pick(q_len_v, idx, s)
    kv_end = _pick(kv_end_v, idx, s)
    q_tile, row_ok, token, pos = _query_tile(
        q, _pick(q_start_v, idx, s), q_len, kv_end, qb, h, T, stride_qt, stride_qh, GROUP, BLOCK_Q, BLOCK_M, HEAD_DIM
    )
    q_tile = q_tile.to(k_store.dtype.element_ty)
    row_lo, row_hi = _row_bounds(pos, row_ok, kv_end, rows, window, CAUSAL)
    k0 = tl.min(tl.where(row_ok, row_lo, kv_end), 0).to(tl.int32)
    k1 = tl.max(tl.where(row_ok, row_hi, 0), 0).to(tl.int32)
    col = tl.load(info + s * 4 + 2).to(tl.int64)
    acc, _m_i, l_i = _attend(
        q_tile,
        k_store + col * stride_kc + h * stride_kh,
        v_store + col * stride_vc + h * stride_vh,
        stride_kr,
        stride_vr,
        rows,
        k0,
        k1,
        row_lo,
        row_hi,
        qk_scale,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        DOT_PREC,
    )
    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    ptrs = out + token.to(tl.int64)[:, None] * stride_ot + (h * GROUP + r % GROUP)[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_kernel(
    out,
    o_part,
    lse_part,
    info,
    S,
    rows,
    window,
    stride_ot,
    stride_oh,
    P,
    SLOTS,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    G_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q_SHORT: tl.constexpr,
    S_POW2: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    idx, q_start_v, q_len_v, kv_end_v, lo_v = _segments(info, S, rows, window, CAUSAL, S_POW2)
    covered = (q_start_v <= t) & (t < q_start_v + q_len_v) & (idx < S)
    s = tl.sum(tl.where(covered, idx, 0), 0)
    is_covered = tl.sum(covered.to(tl.int32), 0) > 0
    if is_covered & (_pick(q_len_v, idx, s) > Q_SHORT):
        return  # a long segment's row: _long_kernel wrote it
    nblk, nq, item_end, w_end = _short_plan(q_len_v, kv_end_v, lo_v, Q_SHORT, BLOCK_Q, BLOCK_N)
    W = tl.maximum(tl.sum(nq * nblk, 0), 1).to(tl.int64)
    g = tl.arange(0, G_POW2)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    m_i = tl.full([G_POW2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_POW2], tl.float32)
    acc = tl.zeros([G_POW2, HEAD_DIM], tl.float32)
    nb = _pick(nblk, idx, s)
    if is_covered & (_pick(nq, idx, s) > 0):
        i = t - _pick(q_start_v, idx, s)
        qb = i // BLOCK_Q
        it = _pick(item_end - nq, idx, s) + qb
        off = (_pick(w_end - nq * nblk, idx, s) + qb * nb).to(tl.int64)
        rr = (i - qb * BLOCK_Q) * GROUP + g  # tile rows of this token
        for p in range(((off + 1) * P - 1) // W, ((off + nb) * P - 1) // W + 1):  # programs touching the item
            blocks = ((p + 1) * W) // P - (p * W) // P  # 0: program p had no work
            has = g_ok & (blocks + 0 * g > 0) & (p + it + 0 * g < SLOTS)
            row = ((p + it) * num_kv_heads + h) * BLOCK_M + rr
            lse = tl.load(lse_part + row, mask=has, other=float("-inf"))
            o = tl.load(o_part + row[:, None] * HEAD_DIM + d[None, :], mask=has[:, None], other=0.0)
            m_new = tl.maximum(m_i, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            w = tl.exp2(lse - m_safe)
            l_i = l_i * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o
            m_i = m_new
    o = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    ptrs = out + t.to(tl.int64) * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
    tl.store(ptrs, o.to(out.dtype.element_ty), mask=g_ok[:, None])


# ---- launcher --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SdpaConfig:
    """Launch choices; 0 means "pick by the static heuristic" (see `resolve_config`).

    block_n: keys per tile of the split kernel; block_m: (query, head) rows per split tile (>= 16);
    q_short: segments with q_len <= q_short go through split-K; programs: split programs per KV
    head (P); occupancy: programs per SM that P aims for; *_long: the prefill kernel's tiles.
    """

    block_n: int = 0
    block_m: int = 16
    q_short: int = 16
    programs: int = 0
    occupancy: int = 2
    num_warps: int = 4
    num_stages: int = 3
    block_n_long: int = 0
    block_m_long: int = 64
    num_warps_long: int = 4
    num_stages_long: int = 2
    merge_warps: int = 0


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs keep CPU tests quick
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def resolve_config(
    config: SdpaConfig | None, head_dim: int, dtype: torch.dtype, num_kv_heads: int, device: torch.device
) -> SdpaConfig:
    """Fill every 0 field of `config` from shapes alone (one K+V stage ~32 KiB of shared memory)."""
    cfg = config or SdpaConfig()
    esize = torch.empty((), dtype=dtype).element_size()
    block_n = cfg.block_n or max(16, min(128, triton.next_power_of_2(32768 // (2 * head_dim * esize) + 1) // 2))
    block_n_long = cfg.block_n_long or (32 if head_dim * esize > 256 else 64)
    programs = cfg.programs or max(1, -(-cfg.occupancy * _sm_count(device) // num_kv_heads))
    return replace(cfg, block_n=block_n, block_n_long=block_n_long, programs=programs)


def _check(q, k_store, v_store, seq_info, window, out) -> None:
    if q.dim() != 3 or k_store.dim() != 4 or k_store.shape != v_store.shape:
        raise ContractError(
            f"sdpa_varlen wants q [T, Hq, D] and k_store, v_store [rows, C, Hkv, D] of one shape; got "
            f"{tuple(q.shape)}, {tuple(k_store.shape)}, {tuple(v_store.shape)}"
        )
    num_q_heads, head_dim = q.shape[1:]
    rows, _, num_kv_heads, store_dim = k_store.shape
    if store_dim != head_dim or head_dim < 16 or head_dim & (head_dim - 1):
        raise ContractError(f"head_dim must be one power of two >= 16 in q and stores; got {head_dim}, {store_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ContractError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}; GQA needs Hq % Hkv == 0")
    if rows < 1:
        raise ContractError("the stores have 0 rows; grow the cache before attending")
    if q.dtype not in DTYPES or k_store.dtype not in DTYPES or v_store.dtype != k_store.dtype:
        raise ContractError(
            f"dtypes must be fp16/bf16/fp32 with one store dtype; got {q.dtype}, {k_store.dtype}, {v_store.dtype}"
        )
    if any(x.stride(-1) != 1 for x in (q, k_store, v_store)):
        raise ContractError("q, k_store and v_store need a contiguous last dim (stride 1); call .contiguous()")
    if not (q.device == k_store.device == v_store.device == seq_info.device):
        raise ContractError(
            f"q, stores and seq_info must share a device; got {q.device}, {k_store.device}, "
            f"{v_store.device}, {seq_info.device}"
        )
    if seq_info.dtype != torch.int32 or seq_info.dim() != 2 or seq_info.shape[1] != 4:
        raise ContractError(f"seq_info must be int32 [S, 4]; got {seq_info.dtype} {tuple(seq_info.shape)}")
    if seq_info.stride() != (4, 1):
        raise ContractError("seq_info must be contiguous; pass seq_info.contiguous()")
    if not isinstance(window, int) or window < 0:
        raise ContractError(f"window is {window!r}; use 0 (none) or a positive int")
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1
    ):
        raise ContractError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim; got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )


def sdpa_varlen(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
    out: torch.Tensor | None = None,
    config: SdpaConfig | None = None,
) -> torch.Tensor:
    """Attention of packed queries over the column store (Triton; see the module docstring).

    q: [T, Hq, D] fp16/bf16/fp32; k_store, v_store: [rows, C, Hkv, D] (one dtype, last dim
    contiguous); seq_info: int32 [S, 4] (q_start, q_len, col, kv_end) on q's device; D a power of
    two >= 16; Hq % Hkv == 0. Returns `out` (or a new tensor) [T, Hq, D] in q's dtype.

    Graph-safe: no host reads of device data; grids depend on shapes only; a captured call
    replays correctly with new contents of `seq_info`. Workspace comes from torch.empty (the graph
    pool under capture).

    >>> out = sdpa_varlen(q, k_store, v_store, torch.tensor([[0, 3, 1, 3]], dtype=torch.int32, device="cuda"))
    """
    _check(q, k_store, v_store, seq_info, window, out)
    num_tokens, num_q_heads, head_dim = q.shape
    rows, _, num_kv_heads, _ = k_store.shape
    num_segments = seq_info.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    if num_segments == 0:
        return out.zero_()
    group = num_q_heads // num_kv_heads
    cfg = resolve_config(config, head_dim, k_store.dtype, num_kv_heads, q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    qk_scale = scale * LOG2E
    s_pow2 = max(16, triton.next_power_of_2(num_segments))
    dot_prec = "ieee" if k_store.dtype == torch.float32 else "tf32"
    strides = (q.stride(0), q.stride(1), *k_store.stride()[:3], *v_store.stride()[:3])
    common = dict(CAUSAL=bool(causal), GROUP=group, HEAD_DIM=head_dim, S_POW2=s_pow2, Q_SHORT=cfg.q_short)

    block_q = max(1, cfg.block_m // group)  # queries per split tile
    block_m = max(16, triton.next_power_of_2(block_q * group))
    n_short = min(num_tokens, num_segments)  # most non-empty segments
    max_items = min((num_tokens + n_short * (block_q - 1)) // block_q, num_segments * -(-cfg.q_short // block_q))
    P = cfg.programs
    slots = P + max(max_items, 1)
    lse_part = torch.empty(slots * num_kv_heads * block_m, dtype=torch.float32, device=q.device)
    o_part = torch.empty(slots * num_kv_heads * block_m * head_dim, dtype=torch.float32, device=q.device)
    _split_kernel[(num_kv_heads, P)](
        q,
        k_store,
        v_store,
        seq_info,
        o_part,
        lse_part,
        num_segments,
        num_tokens,
        rows,
        window,
        qk_scale,
        *strides,
        P,
        slots,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        DOT_PREC=dot_prec,
        **common,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_tokens > cfg.q_short:  # otherwise no segment can be long
        block_q_long = max(1, cfg.block_m_long // group)
        block_m_long = max(16, triton.next_power_of_2(block_q_long * group))
        n_long = min(num_segments, num_tokens // (cfg.q_short + 1))
        grid = (-(-num_tokens // block_q_long) + n_long, num_kv_heads)
        _long_kernel[grid](
            q,
            k_store,
            v_store,
            seq_info,
            out,
            num_segments,
            num_tokens,
            rows,
            window,
            qk_scale,
            *strides,
            out.stride(0),
            out.stride(1),
            BLOCK_M=block_m_long,
            BLOCK_Q=block_q_long,
            BLOCK_N=cfg.block_n_long,
            DOT_PREC=dot_prec,
            **common,
            num_warps=cfg.num_warps_long,
            num_stages=cfg.num_stages_long,
        )
    g_pow2 = triton.next_power_of_2(group)
    merge_warps = cfg.merge_warps or (2 if g_pow2 * head_dim <= 1024 else 4)
    _merge_kernel[(num_tokens, num_kv_heads)](
        out,
        o_part,
        lse_part,
        seq_info,
        num_segments,
        rows,
        window,
        out.stride(0),
        out.stride(1),
        P,
        slots,
        G_POW2=g_pow2,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        **common,
        num_warps=merge_warps,
    )
    return out
