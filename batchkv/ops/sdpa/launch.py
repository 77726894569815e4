"""sdpa_varlen: attention of packed queries over the column store, in Triton, capturable.

Contract (the same as `sdpa_varlen_reference`): for each row s of `seq_info` = (q_start, q_len,
col, kv_end), query i of the segment is packed row `q_start + i` at position
`p_i = kv_end - q_len + i`; causal rows attend keys [lo_i, p_i], non-causal rows [lo, kv_end); a
window trims lo; only t >= kv_end - rows is resident, key t at store[t % rows, col] (`rows` the
store's rows unless given). A store of one column (C = 1) is a pool of extents: `col` is the first
row of the segment's extent and key t sits at row `col + t % rows`. GQA: query head h*G + g reads KV
head h (G = Hq // Hkv). Uncovered rows and rows with no key are zeros.

How (device code in `kernels.py` and `long.py`):
- short segments (q_len <= q_short: decode, verify blocks) go through a stream-K split kernel on a
  persistent grid of P programs per head group; every program takes an equal share of all short
  segments' key blocks, so one wave serves any length mix (one sequence of 1024 keys or 64 of up
  to 8192) without a host decision. An item one program covers is written directly; otherwise the
  last of its programs to finish merges the fp32 partials (per-item counters, self-cleaning). The
  same launch writes exact zeros into rows no segment covers: a decode step is one launch;
- long segments (prefill chunks) get one program per query block, with no split (a second launch,
  only when T > q_short);
- on sm_90 every launch is a programmatic dependent launch (`SdpaConfig.pdl`, `ops/pdl.py`): it starts
  while the grid before it (the K/V write, the split kernel) runs, plans its work from the table, and
  waits on the device before it reads q or K/V or writes anything;
- `SdpaConfig.split_merge` (the default's narrow config: steps of at most 2 tokens, tables of at
  most 2 rows), steps of at most q_short tokens whose segments fit one tile: equal runs of every
  segment's keys per program, then a separate merge launch (`splitkv.py`).
`softcap` (Gemma2) caps every score in the tile loops; `sinks` (gpt-oss) rescale each row once where
its output is final (an item's sole program, the merge, the long path). Both are constexpr switches:
a call with neither compiles and runs the kernels it did before.
`live` (int32 [1] on q's device, or None: every row read): the rows of `seq_info` from live[0] on are
empty and not read. A captured graph's table is as long as its width allows (2,048 rows at an 8,192-token
step under max_seqs 1,024) while its step has a few hundred segments; with `live` the split and long
kernels plan over the live rows, as a `SdpaConfig.table_chunk`-row table when they fit (one table load).
`write` = (k, v, slots) first stores the step's K/V rows as `kv_write` does (its own launch, or,
with `SdpaConfig.fuse_write` on a split_merge step, inside the partials kernel).
One program serves `heads` KV heads and their whole query groups, so K/V are read once per group
and each key row read is heads * D contiguous elements.

Why these choices: decode reads ~all of its time from HBM, so the split kernel aims at equal bytes
per program (stream-K) rather than equal splits per sequence, which would leave a long sequence's
programs running after the short ones finished. The grid is fixed by shapes (P from the SM count),
so replays with new lengths need no recapture. Tiles use ~32 KiB of K+V per pipeline stage.
Choices live in `SdpaConfig` (`config.py`); defaults come from a static heuristic (no
triton.autotune, whose first-call benchmarking does not mix with graph capture); `bench/kernel_bench.py
--sweep` and `bench/b1_sweep.py` tune them.

Workspace: the merge counters live in one int32 buffer per device, allocated (zeroed) on the first
call outside any graph capture and never freed; every launch leaves them zero. Two launches that
run at the same time on different streams would share them: batchkv attends on one stream.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton

from batchkv.checks import int_arg
from batchkv.errors import ContractError
from batchkv.ops.kv_write_triton import check_kv_write, launch_kv_write
from batchkv.ops.pdl import pdl_kwargs
from batchkv.ops.rope import check_rope
from batchkv.ops.sdpa.checks import check_call, check_extras
from batchkv.ops.sdpa.common import SOFTCAP_APPROX, SOFTCAP_EXACT
from batchkv.ops.sdpa.config import DEFAULT_CONFIG, SdpaConfig, pow2_floor, resolve_config
from batchkv.ops.sdpa.kernels import split_kernel
from batchkv.ops.sdpa.long import long_kernel
from batchkv.ops.sdpa.splitkv import split_merge, takes_split_merge
from batchkv.ops.support import e4m3_cvt_asm, quantized, tma_loads

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no host descriptors, pointer loads only
    TensorDescriptor = None

__all__ = ["DEFAULT_CONFIG", "SdpaConfig", "resolve_config", "sdpa_varlen"]

LOG2E = 1.4426950408889634  # 1/ln(2)
# soft-capping on NVIDIA GPUs with 16-bit queries uses the hardware tanh (one special-function op per
# score; the exact form costs 1.39x on prompt chunks, softcap-sinks-ab-h200.json); False: the exact form
SOFTCAP_TANH_APPROX = True
AXIS32_LIMIT = 2**31  # work-axis products (blocks * programs) below this use 32-bit math in the kernel


_COUNTERS: dict[tuple[str, int | None], list[torch.Tensor]] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed int32 merge counters, at least `needed` of them.

    Allocated outside graph capture only; a larger buffer replaces a smaller one for new calls,
    but every buffer stays alive, since graphs captured with it keep using it."""
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    key = (device.type, index)
    held = _COUNTERS.setdefault(key, [])
    if held and held[-1].numel() >= needed:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ContractError(
            f"sdpa_varlen needs {needed} merge counters on {device} but may not allocate them during graph "
            "capture; call it once with the same shapes before capturing (a warm-up does this)"
        )
    held.append(torch.zeros(max(1 << 16, triton.next_power_of_2(needed)), dtype=torch.int32, device=device))
    return held[-1]


def _regs(max_regs: int, device: torch.device) -> dict:
    """Triton's `maxnreg` launch option when a cap is wanted (CUDA only; the interpreter has none)."""
    return {"maxnreg": max_regs} if max_regs and device.type == "cuda" else {}


def _softcap_mode(softcap: float, q: torch.Tensor) -> int:
    """The kernels' SOFTCAP switch: 0 without a cap; the hardware tanh (`SOFTCAP_APPROX`) for 16-bit
    queries on NVIDIA GPUs while `SOFTCAP_TANH_APPROX` is on; else the exact formulation (the
    interpreter runs no inline PTX; fp32 queries keep fp32's accuracy)."""
    if not softcap:
        return 0
    nvidia = q.device.type == "cuda" and torch.version.hip is None
    return SOFTCAP_APPROX if SOFTCAP_TANH_APPROX and nvidia and q.dtype != torch.float32 else SOFTCAP_EXACT


def _layout(store: torch.Tensor) -> tuple[int, int, int]:
    """A store's (row, column, head) strides; in a pool (one column) `col` counts rows, so its column
    stride is the row stride (the stride of a size-1 axis is arbitrary in torch)."""
    row, column, head = store.stride()[:3]
    return row, row if store.shape[1] == 1 else column, head


def _write_here(k_store, v_store, write, k_scale, v_scale, fused: bool, q, rope):
    """Check `write` = (k, v, slots) as `kv_write` does; launch `kv_write` unless the partials kernel
    will store the rows (`fused`: never with `rope`, which the launch applies to k and q). Returns the q
    to attend with (rotated under `rope`) and what split_merge still has to write: `write`, or None."""
    try:
        flat = [s.view(-1, *s.shape[2:]) for s in (k_store, v_store)]
    except RuntimeError as exc:
        raise ContractError(f"sdpa_varlen: write needs stores contiguous over rows and columns ({exc})") from exc
    check_kv_write(*flat, *write, k_scale, v_scale)
    if fused:
        return q, write
    rotated = launch_kv_write(*flat, *write, k_scale, v_scale, None if rope is None else (q, *rope))
    return (q if rotated is None else rotated), None


def tma_views(k_store: torch.Tensor, v_store: torch.Tensor, block_n: int) -> tuple | None:
    """Host TMA descriptors of K and V as [R, C * Hkv * D] (R the stores' rows), boxes of block_n key rows
    and D columns, for the long path's interior loads; None where TMA cannot serve: a device below
    sm_90 or not NVIDIA's (the interpreter can), K and V of different shapes, rows whose (C, Hkv, D)
    part is not contiguous, or a store not 16-byte aligned (TMA's rule for the base and every stride but the last)."""
    if TensorDescriptor is None or not tma_loads(k_store.device) or k_store.shape != v_store.shape:
        return None
    rows, columns, heads, dim = k_store.shape
    width, esize = columns * heads * dim, k_store.element_size()
    strides = k_store.stride()
    if strides[2:] != (dim, 1) or (columns > 1 and strides[1] != heads * dim) or (rows > 1 and strides[0] < width):
        return None
    if any(s.data_ptr() % 16 or s.stride(0) * esize % 16 for s in (k_store, v_store)):
        return None
    return tuple(TensorDescriptor(s, [rows, width], [s.stride(0), 1], [block_n, dim]) for s in (k_store, v_store))


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rows: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    max_q_len: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries over the column store (Triton; contract in the module docstring).

    q: [T, Hq, D] fp16/bf16/fp32; k_store [rows, C, Hkv, D], v_store [rows, C, Hkv, Dv], one
    dtype, last dim contiguous; seq_info: int32 [S, 4] rows (q_start, q_len, col, kv_end) on q's
    device; D and Dv multiples of 16 from 16 to 256 (the keys' and the values' widths: multi-head
    latent attention's differ; tiles are the next power of two, masked); Hq % Hkv == 0. scale
    defaults to 1/sqrt(D); window 0 means none. Returns `out` (or a new tensor) [T, Hq, Dv] in q's
    dtype. q is cast to the store dtype for the QK dot; accumulation is fp32; fp32 dots are IEEE (not tf32).
    e4m3 stores (`torch.float8_e4m3fn`) also take k_scale, v_scale: fp32 [rows, C, Hkv] (the value
    is code * scale; one set of strides, any, rows contiguous the fast layout: `empty_scales`);
    their codes are read in pairs (even strides and offsets) and converted exactly to fp16 (fp32
    for fp32 q) in registers for the dots. Under `SdpaConfig.e4m3_qk_long` (the default's) the rows
    of segments longer than `q_short` tokens (prompt chunks; verify blocks of 17-32 tokens) instead
    round q to e4m3 per (query, head) row and take QK^T as an e4m3 dot on the codes; shorter
    segments keep exact queries.

    Graph-safe: nothing is read back to the host and grids depend on shapes only, so a captured call
    replays correctly after new contents are copied into `seq_info`. The fp32 partials come from
    torch.empty (the graph's pool under capture); the merge counters are allocated by the first call on
    a device, not under capture (warm up first), and left zero by every call. One stream at a time.

    write: (k, v, slots), this step's K/V rows [W, Hkv, D] and their flat store slots [W] (slot s
    is store row s // C, column s % C), written first exactly as `kv_write` writes them into the
    stores viewed [rows * C, Hkv, D] (which must be contiguous over rows and columns), so the
    attention sees them; checked like `kv_write`'s arguments. None: the stores are only read.

    rows: the ring modulus and residency bound (default the stores' row count): key t of a segment is
    read at row `t % rows` of its column, and keys below kv_end - rows are not resident. With a one-column
    pool ([P, 1, Hkv, D]) pass any bound on kv_end or a ring layer's full ring (shorter never wraps).

    max_q_len: a bound promised on every q_len (host-known, part of a captured graph's key; None: any); at
    most `q_short`, the long kernel is not launched (a longer segment's rows come out as zeros). rope:
    (cos, sin) [T, D] of q's dtype: q and write's k come unrotated, and the write's launch rotates both
    (transformers' rotate-half RoPE, its roundings; `batchkv.ops.rope`); needs `write`. live: below.

    >>> info = torch.tensor([[0, 1, 3, 700], [1, 4, 0, 52]], dtype=torch.int32, device="cuda")
    >>> out = sdpa_varlen(q, k_store, v_store, info)  # q [5, 32, 128], stores [1024, 65, 8, 128]
    """
    check_call(q, k_store, v_store, seq_info, scale, window, out, k_scale, v_scale)
    check_extras(q, softcap, sinks, live)
    rope is None or check_rope(q, write, rope)
    rows = k_store.shape[0] if rows is None else int_arg("sdpa_varlen: rows", rows, 1, 2**31 - 1, error=ContractError)
    max_q_len is None or int_arg("sdpa_varlen: max_q_len", max_q_len, 1, 2**31 - 1, error=ContractError)
    (num_tokens, num_q_heads, head_dim), num_segments = q.shape, seq_info.shape[0]
    out = q.new_empty(num_tokens, num_q_heads, v_store.shape[3]) if out is None else out
    group, quant = num_q_heads // k_store.shape[2], quantized(k_store.dtype)
    # tiles of a power of two of columns: keys' (and queries') k_tile, values' (and the output's) v_tile
    k_tile, v_tile = triton.next_power_of_2(head_dim), triton.next_power_of_2(v_store.shape[3])
    cfg, same_layout = _choose_config(config or DEFAULT_CONFIG, q, k_store, v_store, num_segments, k_tile, v_tile)
    fused = num_tokens > 0 and num_segments > 0 and cfg.fuse_write and takes_split_merge(num_tokens, group, cfg, quant)
    fused = fused and write is not None and write[0].shape[0] <= num_tokens and rope is None  # W rows a program
    if write is not None:
        q, write = _write_here(k_store, v_store, write, k_scale, v_scale, fused, q, rope)  # write: None once written
    if num_tokens == 0 or num_segments == 0:
        return out if num_tokens == 0 else out.zero_()
    long = num_tokens > cfg.q_short and (max_q_len is None or max_q_len > cfg.q_short)  # a segment can be long
    _launch(q, k_store, v_store, k_scale, v_scale, seq_info, out, cfg, same_layout, quant, k_tile, v_tile, rows, scale,
            causal, window, write, softcap, sinks, long, live)  # fmt: skip
    return out


def _choose_config(config: SdpaConfig, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                   num_segments: int, k_tile: int, v_tile: int) -> tuple[SdpaConfig, bool]:  # fmt: skip
    """A call's resolved config and whether V's strides are K's: `config.narrow` for a narrow step (a
    static-shape choice: the same for every replay of a graph), resolved for the wider of the key and
    value tiles, the store dtype, the device and the query dtype, with the variants that assume one
    width and one layout for K and V (warp split, prefetch, TMA long loads, fused write) turned off
    otherwise."""
    num_tokens, _, head_dim = q.shape
    num_kv_heads, value_dim = k_store.shape[2], v_store.shape[3]
    if config.narrow is not None and (num_tokens <= config.narrow_width or num_segments <= config.narrow_segments):
        config = config.narrow
    cfg = resolve_config(config, max(k_tile, v_tile), k_store.dtype, num_kv_heads, q.device, q.dtype != torch.float32)
    same_layout = _layout(v_store) == _layout(k_store)  # V's strides are K's
    if not (head_dim == value_dim == k_tile and same_layout):  # variants that assume one width and layout: off
        cfg = replace(cfg, warp_split=1, prefetch=0, tma_long=False, fuse_write=False)
    return cfg, same_layout


def _launch(q, k_store, v_store, k_scale, v_scale, seq_info, out, cfg: SdpaConfig, same_layout: bool, quant: bool,
            k_tile: int, v_tile: int, rows: int, scale, causal, window, write, softcap, sinks,
            long: bool, live: torch.Tensor | None) -> None:  # fmt: skip
    """Launch a step with tokens and segments: the arguments every path shares (scalars, strides,
    constexprs, soft-cap and sinks, V's layout), then the path: `split_merge`'s two launches for a
    narrow step, else the split kernel and, when a segment can be long (`long`: T > q_short and no
    max_q_len of at most q_short), the long kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_segments, columns, num_kv_heads, value_dim = seq_info.shape[0], *k_store.shape[1:3], v_store.shape[3]
    group = num_q_heads // num_kv_heads
    s_pow2 = max(16, triton.next_power_of_2(num_segments))
    chunked = live is not None and 0 < cfg.table_chunk < s_pow2  # the plans read the live rows only
    qk_scale = (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E
    dots = q.dtype if quant else k_store.dtype  # the dtype tl.dot runs in
    cvt_asm = quant and e4m3_cvt_asm(q.device)  # e4m3 codes converted by inline PTX (NVIDIA sm_89+)
    k_scale, v_scale = (k_scale, v_scale) if quant else (k_store, v_store)  # unread without QUANT
    scale_strides = k_scale.stride() if quant else (0, 0, 0)  # (row, column, head)
    store_strides, v_strides = _layout(k_store), _layout(v_store)
    if columns == 1:  # a pool: `col` counts rows (as in `_layout`)
        scale_strides = (scale_strides[0], scale_strides[0], scale_strides[2])
    strides = (q.stride(0), q.stride(1), *store_strides, *scale_strides, out.stride(0), out.stride(1))
    common = dict(
        QUANT=quant,
        CAUSAL=bool(causal),
        GROUP=group,
        HEAD_DIM=k_tile,
        K_DIM=head_dim,
        Q_SHORT=cfg.q_short,
        S_POW2=s_pow2,
        TABLE_CHUNK=cfg.table_chunk if chunked else s_pow2,
        DOT_PREC="ieee" if dots == torch.float32 else "tf32",
        # V in K's layout: the kernels take K's strides for V, so K and V tiles share their row offsets
        # (with V's own strides the loops computed both; the H200 had them 6% slower on prompt chunks)
        SAME_STRIDES=same_layout,
    )
    args = (num_segments, num_tokens, rows, window, qk_scale)
    table = (seq_info, live if chunked else seq_info)  # (the table, its live count: unread unless chunked)
    # soft-cap in log2 units (the scores' own); sinks unread (any pointer) without SINKS
    extras = dict(cap2=float(softcap) * LOG2E, SOFTCAP=_softcap_mode(softcap, q), sinks=q if sinks is None else sinks,
                  SINKS=sinks is not None)  # fmt: skip
    values = dict(stride_vr=v_strides[0], stride_vc=v_strides[1], stride_vh=v_strides[2], V_TILE=v_tile,
                  V_DIM=value_dim)  # fmt: skip
    if takes_split_merge(num_tokens, group, cfg, quant):  # the two-launch variant for narrow steps
        launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_regs(cfg.max_regs, q.device))
        split_merge(q, k_store, v_store, k_scale, v_scale, seq_info, out, args, strides, cfg, common,
                    cvt_asm, launch, write, extras)  # fmt: skip
        return
    _launch_split(q, k_store, v_store, k_scale, v_scale, table, out, args, strides, cfg, common, extras, values,
                  cvt_asm, long)  # fmt: skip
    if long:
        _launch_long(q, k_store, v_store, k_scale, v_scale, table, out, args, strides, cfg, common, extras, values,
                     cvt_asm, softcap)  # fmt: skip


def _launch_split(q, k_store, v_store, k_scale, v_scale, table: tuple, out, args: tuple, strides: tuple,
                  cfg: SdpaConfig, common: dict, extras: dict, values: dict, cvt_asm: bool,
                  long: bool) -> None:  # fmt: skip
    """The stream-K split kernel over the short segments (and the zeros of uncovered rows): block_q
    queries per item, at most max_items items over all short segments, on `cfg.programs` programs
    per head group, with its fp32 partials (torch.empty) and the device's merge counters."""
    num_segments, num_tokens, rows = args[:3]
    num_kv_heads, group, v_tile = k_store.shape[2], common["GROUP"], values["V_TILE"]
    heads, groups = cfg.heads, num_kv_heads // cfg.heads
    block_q = max(1, cfg.block_m // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    live = min(num_tokens, num_segments)  # most non-empty segments
    max_items = min((num_tokens + live * (block_q - 1)) // block_q, num_segments * -(-cfg.q_short // block_q))
    slots = cfg.programs + max_items
    lse_part = torch.empty(slots * num_kv_heads * block_m, dtype=torch.float32, device=q.device)
    o_part = torch.empty(slots * num_kv_heads * block_m * v_tile, dtype=torch.float32, device=q.device)
    counters = _counters(q.device, max_items * groups)
    merge_rows = min(block_m, cfg.merge_rows or triton.next_power_of_2(group))
    hg_pow2 = triton.next_power_of_2(heads * group)
    axis_bound = max_items * -(-rows // cfg.block_n)  # most key blocks on the work axis (an item spans <= rows keys)
    split_kernel[(groups, cfg.programs)](
        q, k_store, v_store, k_scale, v_scale, *table, out, o_part, lse_part, counters, *args, cfg.programs,
        max_items, *strides,
        HEADS=heads, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, MIN_BLOCKS=cfg.min_blocks, LONG=long,
        SKIP_MASKS=cfg.skip_masks, MERGE_ROWS=merge_rows,
        MERGE_SLOTS=min(64, pow2_floor(cfg.merge_tile // (heads * merge_rows * v_tile))), HG_POW2=hg_pow2,
        ZERO_ROWS=pow2_floor(2048 // (hg_pow2 * v_tile)), AXIS64=axis_bound * slots >= AXIS32_LIMIT,
        WARP_SPLIT=cfg.warp_split, PREFETCH=cfg.prefetch, SECTOR=32 // k_store.dtype.itemsize,
        PREFETCH_CHECK=cfg.prefetch > 0 and q.device.type != "cuda", MERGE_STAGES=cfg.merge_stages,
        CVT_ASM=cvt_asm, **common, **extras, **values, **pdl_kwargs(q.device, cfg.pdl),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_regs(cfg.max_regs, q.device),
    )  # fmt: skip


def _launch_long(q, k_store, v_store, k_scale, v_scale, table: tuple, out, args: tuple, strides: tuple, cfg: SdpaConfig,
                 common: dict, extras: dict, values: dict, cvt_asm: bool, softcap: float) -> None:  # fmt: skip
    """The long kernel over the segments longer than q_short (prompt chunks): one program per query
    block, no split; e4m3 QK dots under `cfg.e4m3_qk_long` where they apply, TMA loads where
    `tma_views` can serve them."""
    num_segments, num_tokens, _rows, _window, qk_scale = args
    num_kv_heads, group, quant, head_dim = k_store.shape[2], common["GROUP"], common["QUANT"], common["K_DIM"]
    block_q_long = max(1, cfg.block_m_long // group)
    most_long = min(num_segments, num_tokens // (cfg.q_short + 1))
    e4m3_dots = q.device.type == "cpu" or cvt_asm  # NVIDIA sm_89+, or the interpreter
    qk_e4m3 = quant and cfg.e4m3_qk_long and q.dtype != torch.float32 and head_dim >= 32 and qk_scale > 0
    qk_e4m3 = qk_e4m3 and e4m3_dots and not softcap  # a cap works on true scores: exact queries
    descs = tma_views(k_store, v_store, cfg.block_n_long) if cfg.tma_long else None
    long_kernel[((-(-num_tokens // block_q_long) + most_long) * num_kv_heads,)](
        q, k_store, v_store, k_scale, v_scale, *table, out, *(descs or (k_store, v_store)), *args, num_kv_heads,
        *strides,
        QK_E4M3=qk_e4m3, TMA=descs is not None,
        HW_CAST=qk_e4m3 and cvt_asm, BLOCK_M=max(16, triton.next_power_of_2(block_q_long * group)),
        BLOCK_Q=block_q_long,
        BLOCK_N=cfg.block_n_long, **common, **extras, **values, **pdl_kwargs(q.device, cfg.pdl),
        num_warps=cfg.num_warps_long, num_stages=cfg.num_stages_long,
    )  # fmt: skip
