"""sdpa_varlen: attention of packed queries over the column store, in Triton, capturable.

Contract (the same as `sdpa_varlen_reference`): for each row s of `seq_info` = (q_start, q_len,
col, kv_end), query i of the segment is packed row `q_start + i` at position
`p_i = kv_end - q_len + i`; causal rows attend keys [lo_i, p_i], non-causal rows [lo, kv_end); a
window trims lo; only t >= kv_end - rows is resident, key t at store[t % rows, col]. GQA: query
head h*G + g reads KV head h (G = Hq // Hkv). Uncovered rows and rows with no key are zeros.

How (device code and its algorithm in `sdpa_varlen_kernels.py`):
- short segments (q_len <= q_short: decode, verify blocks) go through a stream-K split kernel on a
  persistent grid of P programs per KV head; every program takes an equal share of all short
  segments' key blocks, so one wave serves any length mix (one sequence of 1024 keys or 64 of up
  to 8192) without a host decision; fp32 partials are merged with their log-sum-exp;
- long segments (prefill chunks) get one program per query block, with no split;
- a merge kernel over (T, Hq) combines partials and writes exact zeros for uncovered rows.
One KV head's whole query group shares a program, so K/V are read once per group; the (query,
group head) pairs are flattened into the tile's M rows, padded to 16 for tl.dot.

Why these choices: decode reads ~all of its time from HBM, so the split kernel aims at equal bytes
per program (stream-K) rather than equal splits per sequence, which would leave a long sequence's
programs running after the short ones finished. The grid is fixed by shapes (P from the SM count),
so replays with new lengths need no recapture. Tiles use ~32 KiB of K+V per pipeline stage.
Choices live in `SdpaConfig`; defaults come from a static heuristic (no triton.autotune, whose
first-call benchmarking does not mix with graph capture); `bench/kernels.py --sweep` tunes them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

from batchkv.errors import ContractError
from batchkv.ops.sdpa_varlen_kernels import long_kernel, merge_kernel, split_kernel

LOG2E = 1.4426950408889634  # 1/ln(2)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class SdpaConfig:
    """Launch choices; a 0 field is filled by `resolve_config` from shapes and the device.

    block_n: keys per split tile; block_m: (query, head) rows per split tile (>= 16);
    q_short: segments with q_len <= q_short take the split path; programs: split programs per KV
    head (P); occupancy: split programs per SM that P aims at; min_blocks: fewest key blocks a split
    program takes (fewer programs share a short total); *_long: the prefill kernel.
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
    min_blocks: int = 1
    merge_warps: int = 4


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: few programs keep CPU tests quick
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@functools.lru_cache(maxsize=256)
def resolve_config(
    config: SdpaConfig | None, head_dim: int, dtype: torch.dtype, num_kv_heads: int, device: torch.device
) -> SdpaConfig:
    """`config` with every 0 field chosen from shapes alone (host-only, no device reads)."""
    cfg = config or SdpaConfig()
    esize = dtype.itemsize
    stage_keys = 32768 // (2 * head_dim * esize)  # keys whose K+V fill 32 KiB
    block_n = cfg.block_n or max(16, min(128, 1 << (stage_keys.bit_length() - 1)))
    block_n_long = cfg.block_n_long or (32 if head_dim * esize > 256 else 64)
    programs = cfg.programs or max(1, -(-cfg.occupancy * _sm_count(device) // num_kv_heads))
    if min(block_n, block_n_long, cfg.block_m, cfg.block_m_long) < 16 or cfg.q_short < 1:
        raise ContractError(f"{cfg}: tiles need at least 16 rows and keys, and q_short >= 1")
    return replace(cfg, block_n=block_n, block_n_long=block_n_long, programs=programs)


def _check(q, k_store, v_store, seq_info, window, out) -> None:
    if q.dim() != 3 or k_store.dim() != 4 or k_store.shape != v_store.shape:
        raise ContractError(
            "sdpa_varlen wants q [T, Hq, D] and k_store, v_store [rows, C, Hkv, D] of one shape; "
            f"got {tuple(q.shape)}, {tuple(k_store.shape)}, {tuple(v_store.shape)}"
        )
    num_q_heads, head_dim = q.shape[1:]
    rows, _, num_kv_heads, store_dim = k_store.shape
    if store_dim != head_dim or head_dim < 16 or head_dim & (head_dim - 1):
        raise ContractError(f"head_dim must be one power of two >= 16 in q and the stores; got {head_dim}, {store_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ContractError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}; GQA needs Hq % Hkv == 0")
    if rows < 1:
        raise ContractError("the stores have 0 rows; grow the cache before attending")
    if q.dtype not in DTYPES or k_store.dtype not in DTYPES or v_store.dtype != k_store.dtype:
        raise ContractError(
            f"q and the stores must be fp16/bf16/fp32, one dtype for both stores; got {q.dtype}, "
            f"{k_store.dtype}, {v_store.dtype}"
        )
    if q.stride(-1) != 1 or k_store.stride(-1) != 1 or k_store.stride() != v_store.stride():
        raise ContractError(
            "q and the stores need a contiguous last dim, and k_store and v_store the same strides; "
            f"got {q.stride()}, {k_store.stride()}, {v_store.stride()} (call .contiguous())"
        )
    if not q.device == k_store.device == v_store.device == seq_info.device:
        raise ContractError(
            f"q, the stores and seq_info must share a device; got {q.device}, {k_store.device}, "
            f"{v_store.device}, {seq_info.device}"
        )
    if seq_info.dtype != torch.int32 or seq_info.dim() != 2 or seq_info.shape[1] != 4 or seq_info.stride(-1) != 1:
        raise ContractError(f"seq_info must be int32 [S, 4], rows contiguous; got {seq_info.dtype} {seq_info.shape}")
    if seq_info.shape[0] > 1 and seq_info.stride(0) != 4:
        raise ContractError("seq_info rows must be packed (stride 4); pass seq_info.contiguous()")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ContractError(f"window is {window!r}; use 0 (none) or a positive int")
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1
    ):
        raise ContractError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
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
    """Attention of packed queries over the column store (Triton; contract in the module docstring).

    q: [T, Hq, D] fp16/bf16/fp32; k_store, v_store: [rows, C, Hkv, D], one dtype and strides,
    last dim contiguous; seq_info: int32 [S, 4] rows (q_start, q_len, col, kv_end) on q's device;
    D a power of two >= 16; Hq % Hkv == 0. scale defaults to 1/sqrt(D); window 0 means none.
    Returns `out` (or a new tensor) [T, Hq, D] in q's dtype. q is cast to the store dtype for the
    QK dot; accumulation is fp32; fp32 stores use IEEE (not tf32) dots.

    Graph-safe: nothing is read back to the host and grids depend on shapes only, so a captured
    call replays correctly after new contents are copied into `seq_info`. The fp32 workspace
    comes from torch.empty (the graph's pool under capture).

    >>> info = torch.tensor([[0, 1, 3, 700], [1, 4, 0, 52]], dtype=torch.int32, device="cuda")
    >>> out = sdpa_varlen(q, k_store, v_store, info)  # q [5, 32, 128], stores [1024, 65, 8, 128]
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
    qk_scale = (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E
    strides = (q.stride(0), q.stride(1), *k_store.stride()[:3])
    common = dict(
        CAUSAL=bool(causal),
        GROUP=group,
        HEAD_DIM=head_dim,
        Q_SHORT=cfg.q_short,
        S_POW2=max(16, triton.next_power_of_2(num_segments)),
    )
    dot_prec = "ieee" if k_store.dtype == torch.float32 else "tf32"
    args = (num_segments, num_tokens, rows, window, qk_scale)

    # Split path: block_q queries per tile; at most max_items query blocks over all short segments.
    block_q = max(1, cfg.block_m // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    live = min(num_tokens, num_segments)  # most non-empty segments
    max_items = min((num_tokens + live * (block_q - 1)) // block_q, num_segments * -(-cfg.q_short // block_q))
    slots = cfg.programs + max_items
    lse_part = torch.empty(slots * num_kv_heads * block_m, dtype=torch.float32, device=q.device)
    o_part = torch.empty(slots * num_kv_heads * block_m * head_dim, dtype=torch.float32, device=q.device)
    split_kernel[(num_kv_heads, cfg.programs)](
        q, k_store, v_store, seq_info, o_part, lse_part, *args, cfg.programs, slots, *strides,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, MIN_BLOCKS=cfg.min_blocks, DOT_PREC=dot_prec,
        **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_tokens > cfg.q_short:  # else no segment can be long: skip the launch
        block_q_long = max(1, cfg.block_m_long // group)
        most_long = min(num_segments, num_tokens // (cfg.q_short + 1))
        long_kernel[(-(-num_tokens // block_q_long) + most_long, num_kv_heads)](
            q, k_store, v_store, seq_info, out, *args, *strides, out.stride(0), out.stride(1),
            BLOCK_M=max(16, triton.next_power_of_2(block_q_long * group)), BLOCK_Q=block_q_long,
            BLOCK_N=cfg.block_n_long, DOT_PREC=dot_prec, **common,
            num_warps=cfg.num_warps_long, num_stages=cfg.num_stages_long,
        )  # fmt: skip
    merge_kernel[(num_tokens, num_q_heads)](
        out, o_part, lse_part, seq_info, num_segments, rows, window, cfg.programs, slots,
        out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, **common,
        MIN_BLOCKS=cfg.min_blocks, CHUNK=min(64, triton.next_power_of_2(cfg.programs)), num_warps=cfg.merge_warps,
    )  # fmt: skip
    return out
